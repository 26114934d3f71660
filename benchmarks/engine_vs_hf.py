"""Offline throughput: pdserve's engine against HF transformers `generate` in static batches.

Workload: 32 chat requests from a fixed seed, prompts 32-512 tokens, outputs 16-256 tokens (both
uniform). Both systems run the same default model (float32, same weights) in this process with
the same torch thread count, and both must produce exactly each request's output length
(ignore_eos / min_new_tokens). HF takes the requests in arrival order, 8 at a time, left-padded;
a batch runs until its longest request is done, which is what static batching costs.

Prints one JSON line: output tok/s of each and their ratio (goal: ratio >= 4).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def make_workload(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    vocab = (
        "time person year way day thing man world life hand part child eye woman place work week case "
        "point government company number group problem fact water river city story music garden"
    ).split()
    requests = []
    for _ in range(n):
        target = rng.randint(32, 512)
        words = [rng.choice(vocab) for _ in range(target)]

        def encode(k: int) -> list[int]:
            return tokenizer.encode_chat(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " ".join(words[:k])}]
            )

        k = target
        ids = encode(k)
        while len(ids) > target and k > 0:  # drop the overshoot: these words are ~1 token each
            k = max(0, k - (len(ids) - target))
            ids = encode(k)
        requests.append((ids, rng.randint(16, 256)))
    return requests


def hf_model_from(loaded):
    """An HF LlamaForCausalLM holding exactly our weights (no second GGUF parse)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    a = loaded.arch
    cfg = LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        bos_token_id=a.bos_token_id,
        eos_token_id=a.eos_token_ids[0],
        pad_token_id=a.eos_token_ids[0],
    )
    model = LlamaForCausalLM(cfg).eval()
    missing, _ = model.load_state_dict(loaded.weights, strict=False)
    assert all("lm_head" in m or "rotary" in m for m in missing), missing
    model.tie_weights()
    return model.to(torch.float32)


def run_hf(model, requests, batch_size: int, pad_id: int) -> tuple[float, int]:
    import torch

    useful, t0 = 0, time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, (ids, _) in enumerate(batch):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        n = max(out for _, out in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
        useful += sum(out for _, out in batch)
    return time.perf_counter() - t0, useful


def run_ours(llm, requests) -> tuple[float, int]:
    from pdserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in requests]
    t0 = time.perf_counter()
    outs = llm.generate([ids for ids, _ in requests], params)
    dt = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(out for _, out in requests)
    return dt, produced


def main() -> int:
    from pdserve.config_rules import QUANTIZATIONS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8, help="HF static batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="pdserve's weights (HF runs float32 either way; the line says which)",
    )
    args = ap.parse_args()

    import torch

    from pdserve import LLM
    from pdserve.model.loader import load_model_files
    from pdserve.utils.cpu import describe

    torch.set_num_threads(args.threads)
    loaded = load_model_files("smollm2-135m")
    # No prefix cache: HF has none, and the warm-up requests would otherwise be cache hits.
    quantized = (
        load_model_files("smollm2-135m", quantization=args.quantization)
        if args.quantization != "none"
        else loaded
    )
    llm = LLM(
        model="smollm2-135m",
        loaded=quantized,
        threads=args.threads,
        prefix_cache=False,
        quantization=args.quantization,
    )
    del quantized
    requests = make_workload(llm.tokenizer, args.requests, args.seed)
    run_ours(llm, requests[:2])  # warm-up
    ours_s, ours_tokens = run_ours(llm, requests)
    hf = hf_model_from(loaded)
    run_hf(hf, requests[:1], 1, loaded.arch.eos_token_ids[0])  # warm-up
    hf_s, hf_tokens = run_hf(hf, requests, args.batch_size, loaded.arch.eos_token_ids[0])
    ours_tps, hf_tps = ours_tokens / ours_s, hf_tokens / hf_s
    print(
        json.dumps(
            {
                "benchmark": "engine_vs_hf",
                "requests": len(requests),
                "threads": args.threads,
                "cpu": describe(),
                "pdserve_quantization": llm.config.model.quantization,  # auto: as resolved
                "hf_dtype": "float32",
                "prompt_tokens": sum(len(ids) for ids, _ in requests),
                "output_tokens": ours_tokens,
                "pdserve_output_tok_s": round(ours_tps, 1),
                "hf_static_batch_output_tok_s": round(hf_tps, 1),
                "hf_batch_size": args.batch_size,
                "ratio": round(ours_tps / hf_tps, 2),
                "goal": ">= 4",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
