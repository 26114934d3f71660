"""Random-weight checkpoints in the shapes of models users serve, for benchmarks that must not be
about a 135M model's per-step overheads alone: Llama-3.2-1B and Qwen2.5-0.5B.

Each is made once into the benchmarks' cache (~/.cache/pdserve/shapes/<name>/, or
$PDSERVE_CACHE/shapes/<name>/) and reused:

- hf/: config.json, model.safetensors in bfloat16 (as the real checkpoints are stored), and the
  tokenizer. The weights are random (nothing is downloaded): normal with the configs' initializer
  range, norms one, biases zero.
- <Name>.F16.gguf: made from hf/ with llama.cpp's own converter (convert_hf_to_gguf.py, from the
  sources bench/llamacpp.py builds), then <Name>.Q4_0 / Q4_1 / Q8_0.gguf with its llama-quantize.

What a step costs is the shape's: every layer at the real sizes, the whole vocabulary in the logits.
Two things are not the real models', and neither changes a step's cost:
- the tokenizer is SmolLM2's (the benchmarks' prompts are counted in it): the vocabulary rows past
  its 49,152 tokens are zero, so greedy decoding never picks an id it cannot print (with random
  rows before them, some logit is above zero); the GGUF converter names those ids [PAD<n>];
- no rope scaling (Llama-3.2's llama3 scaling changes which frequencies rotate, not how many):
  llama.cpp's converter stores it as a rope_freqs tensor that transformers' GGUF reader drops.
The context length is cut to 8,192 positions, which the benchmarks stay far below.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdserve.bench import baseline_venv, llamacpp
from pdserve.common.paths import cache_root

_COMMON = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

# HF configs of the shapes, as the published checkpoints give them (less rope scaling, see above).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2.5-0.5b": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    },
}
FILE_NAMES = {"llama-3.2-1b": "Llama-3.2-1B-shape", "qwen2.5-0.5b": "Qwen2.5-0.5B-shape"}
QUANTS = ("Q4_0", "Q4_1", "Q8_0")


class ShapeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Shape:
    name: str
    hf_dir: Path  # bfloat16 safetensors + tokenizer
    gguf: dict[str, Path]  # F16, Q4_0, Q4_1, Q8_0 -> file

    def params(self) -> int:
        return parameter_count(json.loads((self.hf_dir / "config.json").read_text()))


def parameter_count(cfg: dict) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(cfg).values())


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a dense Llama/Qwen2 config with tied embeddings."""
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, ff = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(n):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg["model_type"] == "qwen2":
            out |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    out["model.norm.weight"] = (h,)
    return out


def cache_dir() -> Path:
    return cache_root() / "shapes"


def write_hf(name: str, dst: Path, tokenizer_gguf: Path, seed: int = 0) -> None:
    """The HF directory of shape `name`: random bfloat16 weights, the tokenizer of `tokenizer_gguf`
    (rows of the vocabulary past it zero)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_gguf.parent, gguf_file=tokenizer_gguf.name)
    cfg = dict(SHAPES[name])
    if len(tok) > cfg["vocab_size"]:
        raise ShapeError(f"the tokenizer has {len(tok)} tokens, more than {name}'s {cfg['vocab_size']}")
    cfg["bos_token_id"] = tok.bos_token_id
    cfg["eos_token_id"] = tok.eos_token_id
    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    tensors = {}
    for key, shape in tensor_shapes(cfg).items():
        if key.endswith("norm.weight"):
            t = torch.ones(shape)
        elif key.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g) * std
            if key == "model.embed_tokens.weight":
                t[len(tok) :] = 0
        tensors[key] = t.to(torch.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(dst)


def _run(cmd: list[str], log: Callable[[str], None], logfile: Path) -> None:
    try:
        baseline_venv.run(cmd, log, logfile)
    except baseline_venv.InstallError as e:
        raise ShapeError(str(e)) from None


def prepare(
    name: str,
    tokenizer_gguf: Path,
    quantize: Path,
    cache: Path | None = None,
    log: Callable[[str], None] = print,
) -> Shape:
    """Shape `name` in the cache, made where missing: the HF directory, then its GGUF files
    (`quantize` is llama.cpp's llama-quantize; its converter comes from the same sources)."""
    if name not in SHAPES:
        raise ShapeError(f"unknown shape {name!r}: choose from {', '.join(SHAPES)}")
    root = (cache or cache_dir()) / name
    root.mkdir(parents=True, exist_ok=True)
    logfile = root / "make.log"
    hf = root / "hf"
    if not (hf / "config.json").exists():
        tmp = root / "hf.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"writing random {name} weights to {hf}")
        # In a child: the 1B shape's float32 staging must not stay in this process's heap.
        _run(
            [sys.executable, "-m", "pdserve.bench.shapes", "hf", name, str(tmp), str(tokenizer_gguf)],
            log,
            logfile,
        )
        tmp.rename(hf)
    base = FILE_NAMES[name]
    files = {"F16": root / f"{base}.F16.gguf"}
    if not files["F16"].exists():
        if importlib.util.find_spec("sentencepiece") is None:
            raise ShapeError("llama.cpp's converter imports sentencepiece: pip install 'pdserve[bench]'")
        src = llamacpp.fetch_sources(llamacpp.cache_dir(), log)
        tmp = files["F16"].with_suffix(".partial")
        # The converter puts its own gguf-py before the installed gguf (older or newer than it).
        cmd = [
            sys.executable,
            "-m",
            "pdserve.bench.shapes",
            "convert",
            str(src / "convert_hf_to_gguf.py"),
            str(hf),
            "--outtype",
            "f16",
            "--outfile",
            str(tmp),
        ]
        _run(cmd, log, logfile)
        tmp.rename(files["F16"])
    for kind in QUANTS:
        files[kind] = llamacpp.convert(quantize, files["F16"], root / f"{base}.{kind}.gguf", kind, log=log)
    return Shape(name, hf, files)


def _convert_main(script: Path, argv: list[str]) -> None:
    """llama.cpp's converter, reading the directory's tokenizer.json as written. It loads the
    tokenizer with transformers' AutoTokenizer, which swaps in a model type's own class (for qwen2,
    Qwen2's pre-tokenizer over SmolLM2's vocabulary): the converter then recognises no tokenizer it
    knows and refuses, where the file itself is SmolLM2's, as it finds for the Llama shape."""
    import runpy

    import transformers

    class AsWritten:
        @staticmethod
        def from_pretrained(path, *args, **kwargs):
            return transformers.PreTrainedTokenizerFast.from_pretrained(path)

    transformers.AutoTokenizer = AsWritten  # the converter imports it when it reads the vocabulary
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))  # as running the script would: its own modules beside it
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "hf":
        write_hf(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    elif len(sys.argv) > 3 and sys.argv[1] == "convert":
        _convert_main(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(
            "usage: python -m pdserve.bench.shapes hf NAME DST_DIR TOKENIZER_GGUF\n"
            "       python -m pdserve.bench.shapes convert CONVERT_HF_TO_GGUF_PY HF_DIR ARGS..."
        )
