"""Peak resident set while loading a Hugging Face checkpoint ÷ the resident set once it is loaded.

A child process writes a scaled random checkpoint in bfloat16 to a temporary directory: `dense`, a
Llama shape (hidden 1024, 12 layers, GQA 16/4 heads, intermediate 2816, the default model's tokenizer
and vocabulary: about 470 MB in two shards); `moe`, a Qwen3-MoE shape (hidden 1024, 6 layers, GQA
16/4 heads with q/k norms, 16 experts of intermediate 512 a layer, top 4, each expert's matrices
stored apart as HF stores them: about 535 MB in two shards, 57% of it experts). Then, for each
quantization, a fresh child process imports everything, reads its own VmHWM, starts an offline
engine on the directory as a worker does (load, build, the KV tiers' weight digest, heap trim; a KV
pool of 16 blocks), and reads VmRSS and VmHWM again. Figure: peak ÷ final resident set (goal ≤ 1.2);
also the load's own rise, (peak − before) ÷ (final − before), and the weight bytes. Prints one JSON
line per model and mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_WRITE = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from pdserve.model.loader import default_gguf_path, load_gguf_tokenizer

path, hidden, layers, kind = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
experts, expert_inter = int(sys.argv[5]), int(sys.argv[6])
tok = load_gguf_tokenizer(str(default_gguf_path()))
heads, kv_heads, inter, vocab = hidden // 64, max(1, hidden // 256), hidden * 11 // 4, tok.vocab_size
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
    "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
    "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids[0],
}
if kind == "moe":
    cfg.update({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 64,
        "num_experts": experts, "num_experts_per_tok": 4, "moe_intermediate_size": expert_inter,
        "norm_topk_prob": True,
    })
(path / "config.json").write_text(json.dumps(cfg))
tok.tok.save(str(path / "tokenizer.json"))
g = torch.Generator().manual_seed(0)

def rand(*shape):
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16()

kv = kv_heads * 64
shards = [{"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden).bfloat16()}, {}]
shards[1]["lm_head.weight"] = rand(vocab, hidden)
for i in range(layers):
    p, s = f"model.layers.{i}.", shards[i * 2 // layers]
    s.update({
        p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
        p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
        p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
        p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
    })
    if kind == "dense":
        s.update({
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
        continue
    s[p + "self_attn.q_norm.weight"] = torch.ones(64).bfloat16()
    s[p + "self_attn.k_norm.weight"] = torch.ones(64).bfloat16()
    s[p + "mlp.gate.weight"] = rand(experts, hidden)
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        s.update({
            q + "gate_proj.weight": rand(expert_inter, hidden), q + "up_proj.weight": rand(expert_inter, hidden),
            q + "down_proj.weight": rand(hidden, expert_inter),
        })
for i, s in enumerate(shards):
    save_file(s, str(path / f"model-{i + 1:05d}-of-00002.safetensors"), metadata={"format": "pt"})
print(sum(f.stat().st_size for f in path.glob("*.safetensors")))
"""

_LOAD = """
import gc, json, sys, time

def mem():
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "VmHWM")}
    return kb["VmRSS"] * 1024, kb["VmHWM"] * 1024

import torch
from pdserve import LLM

torch.set_num_threads(int(sys.argv[3]))
LLM(model="tiny-llama", device_blocks=16)  # every import and lazy initialisation done before measuring
gc.collect()
before = mem()[0]
t0 = time.perf_counter()
llm = LLM(model=sys.argv[1], quantization=sys.argv[2], device_blocks=16, threads=int(sys.argv[3]))
seconds = time.perf_counter() - t0
gc.collect()
rss, peak = mem()
print(json.dumps({"before": before, "rss": rss, "peak": peak, "weight_bytes": llm.engine.weight_bytes,
                  "seconds": seconds}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,moe", help="checkpoints to load: dense, moe")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="default: 12 dense, 6 moe")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-intermediate", type=int, default=512)
    ap.add_argument("--modes", default="none,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for kind in args.models.split(","):
        if kind not in ("dense", "moe"):
            print(f"--models: {kind!r} is not dense or moe", file=sys.stderr)
            return 2
        if not _run(kind, args):
            return 1
    return 0


def _run(kind: str, args: argparse.Namespace) -> bool:
    from pdserve.utils.cpu import describe

    layers = args.layers or (12 if kind == "dense" else 6)
    with tempfile.TemporaryDirectory(prefix="pdserve-load-memory-") as tmp:
        t0 = time.perf_counter()
        written = subprocess.run(
            [
                sys.executable,
                "-c",
                _WRITE,
                tmp,
                str(args.hidden),
                str(layers),
                kind,
                str(args.experts),
                str(args.expert_intermediate),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        file_bytes = int(written.stdout.strip().splitlines()[-1])
        write_s = time.perf_counter() - t0
        for mode in args.modes.split(","):
            out = subprocess.run(
                [sys.executable, "-c", _LOAD, tmp, mode, str(args.threads)],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return False
            r = json.loads(out.stdout.strip().splitlines()[-1])
            # The model's own share: the process before loading (torch, the tokenizer, a tiny engine)
            # is the same in both, so peak ÷ final undersells what loading adds; the rise shows it.
            rise = (r["peak"] - r["before"]) / max(1, r["rss"] - r["before"])
            print(
                json.dumps(
                    {
                        "benchmark": "load_memory",
                        "cpu": describe(),
                        "model": kind,
                        "quantization": mode,
                        "checkpoint_mb": round(file_bytes / 1e6, 1),
                        "weight_mb": round(r["weight_bytes"] / 1e6, 1),
                        "rss_before_mb": round(r["before"] / 1e6, 1),
                        "rss_mb": round(r["rss"] / 1e6, 1),
                        "peak_rss_mb": round(r["peak"] / 1e6, 1),
                        "peak_over_final": round(r["peak"] / r["rss"], 3),
                        "load_rise_peak_over_final": round(rise, 3),
                        "load_seconds": round(r["seconds"], 1),
                        "write_seconds": round(write_s, 1),
                        "goal": "peak_over_final <= 1.2",
                    }
                ),
                flush=True,
            )
    return True


if __name__ == "__main__":
    sys.exit(main())
