"""What a one-machine deployment hands its worker processes (pdserve/worker_process.py): the internal
token, which they need, and never the router's client or admin keys, in their config file or their
environment (a real worker process, its environment read from /proc)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.config import load_config
from pdserve.worker_process import WorkerProcess, write_worker_config


def _environ(proc: WorkerProcess) -> tuple[str, dict[str, str]]:
    """A worker process's environment, raw and as a dict; the process is stopped."""
    try:
        # Popen returns once the child has exec'd: its environment is the worker's from here on.
        raw = Path(f"/proc/{proc.proc.pid}/environ").read_bytes().decode(errors="replace")
    finally:
        proc.stop()
        proc.wait(30)
    return raw, dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_workers_get_the_internal_token_and_none_of_the_routers_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-client-env")
    monkeypatch.setenv("PDSERVE_ADMIN_KEYS", "sk-admin-env")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "sk-admin-cli")
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "tok-env")
    config = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "router.api_keys": ["sk-client-file"],
            "router.admin_keys": ["sk-admin-file"],
            "server.internal_token": "tok-file",
        }
    )
    path = write_worker_config(config, tmp_path / "deployment.yaml")
    text = path.read_text()
    assert "sk-client-file" not in text and "sk-admin-file" not in text
    data = yaml.safe_load(text)
    assert data["server"]["internal_token"] == "tok-file" and data["router"]["admin_keys"] == []

    raw, env = _environ(WorkerProcess("decode", 0, path, "127.0.0.1", 1, None, tmp_path, []))
    assert env.get("PDSERVE_INTERNAL_TOKEN") == "tok-env"
    assert not {"PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_ADMIN_KEY"} & set(env)
    assert "sk-admin" not in raw and "sk-client" not in raw


def test_workers_share_idle_cores_unless_pinned_or_told_not_to(tmp_path, monkeypatch):
    """The core-sharing directory (utils/core_share.py) reaches a worker only where the launcher
    shares cores and the role is not pinned; one inherited from the launcher's own environment never
    does."""
    monkeypatch.setenv("PDSERVE_CORE_SHARE", "/elsewhere")
    path = write_worker_config(
        load_config(overrides={"model.name": "tiny-qwen2"}), tmp_path / "deployment.yaml"
    )
    seen = {}
    for name, cores, share in (("shared", None, True), ("pinned", [0], True), ("own", None, False)):
        _, env = _environ(WorkerProcess("decode", 0, path, "127.0.0.1", 1, cores, tmp_path, [], share))
        seen[name] = env.get("PDSERVE_CORE_SHARE")
    assert seen == {"shared": str(tmp_path / "cores"), "pinned": None, "own": None}
