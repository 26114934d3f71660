"""Structured outputs: what do JSON-schema constraints cost a decode step? Prints one JSON line.

Deployment: `pdserve serve` as installed (PD: router, one prefill and one decode worker) with the
default model (SmolLM2-135M-Instruct). Workload: 8 closed-loop streaming chat clients; each request
asks for a record as JSON. The constrained pass sends one of 50 schemas of varied shape per request
(`response_format` json_schema, temperature 1, numbers with fractions included); the baseline pass,
in the same run, sends the same prompts unconstrained, each with max_tokens and ignore_eos set to
the length its constrained twin produced, so both passes decode the same number of tokens per
request and differ by the grammar only. The figure: p50 TPOT constrained / p50 TPOT baseline
(goal <= 1.15), and the share of constrained outputs that validate with `jsonschema` (an output that
max_tokens cut short is counted apart: numbers with fractions may run long; every other output must
validate).

Then the grammar engines themselves, offline on the same outputs: per schema, compile time and the
time of one token mask at every position of the output, for llguidance (the one pdserve uses) and,
when it is installed, xgrammar.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.json_schemas import schemas  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Write one example record as JSON. Use realistic values."


async def _one(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, usage, reason = "", None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                reason = ch.get("finish_reason") or reason
                piece = ch["delta"].get("content") or ""
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
    n = usage["completion_tokens"] if usage else len(stamps)
    tpot = (stamps[-1] - stamps[0]) / (n - 1) if len(stamps) > 1 and n > 1 else None
    return {
        "text": text,
        "tokens": n,
        "tpot": tpot,
        "ttft": (stamps[0] - t0) if stamps else None,
        "finish_reason": reason,
    }


async def _pass(url: str, bodies: list[dict], streams: int) -> list[dict]:
    results: list[dict] = [{} for _ in bodies]
    queue = list(range(len(bodies)))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results[i] = await _one(client, bodies[i])

        await asyncio.gather(*(worker() for _ in range(streams)))
    return results


def _body(max_tokens: int, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def _mask_times(texts: list[str], cases: list[dict]) -> dict:
    """Compile and per-token mask times of llguidance (and xgrammar if present) on the outputs."""
    import llguidance as ll
    import numpy as np

    from pdserve.common.structured import from_request, grammar
    from pdserve.common.tokenizer import default_gguf_path, load_gguf_tokenizer

    tok = load_gguf_tokenizer(str(default_gguf_path()))
    outputs = [(tok.encode(t, add_special_tokens=False), s) for t, s in zip(texts, cases) if t]
    out: dict[str, dict] = {}
    lltok = ll.LLTokenizer(tok.tok.to_str(), eos_token=tok.eos_token_ids)
    words = (tok.vocab_size + 31) // 32
    bits = np.zeros(words, dtype=np.int32)
    compile_s, mask_s = [], []
    for ids, schema in outputs:
        c = from_request(structured_outputs={"json": schema})
        assert c is not None
        t = time.perf_counter()
        m = ll.LLMatcher(lltok, grammar(c), log_level=0)
        compile_s.append(time.perf_counter() - t)
        for tid in ids:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
            mask_s.append(time.perf_counter() - t)
            if not m.consume_token(tid):
                break
    out["llguidance"] = _times(compile_s, mask_s)
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = {"installed": False}
        return out
    info = xgr.TokenizerInfo(
        [tok.id_to_token(i) for i in range(tok.vocab_size)],
        vocab_type=xgr.VocabType.BYTE_LEVEL,
        vocab_size=tok.vocab_size,
        stop_token_ids=tok.eos_token_ids,
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    compile_s, mask_s = [], []
    for ids, schema in outputs:
        c = from_request(structured_outputs={"json": schema})
        assert c is not None
        t = time.perf_counter()
        cg = compiler.compile_json_schema(c.spec, any_whitespace=False, separators=(", ", ": "))
        m = xgr.GrammarMatcher(cg)
        compile_s.append(time.perf_counter() - t)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            mask_s.append(time.perf_counter() - t)
            if not m.accept_token(tid):
                break
    out["xgrammar"] = _times(compile_s, mask_s)
    return out


def _times(compile_s: list[float], mask_s: list[float]) -> dict:
    q = statistics.quantiles(mask_s, n=100)
    return {
        "compile_ms_p50": round(statistics.median(compile_s) * 1e3, 2),
        "compile_ms_max": round(max(compile_s) * 1e3, 2),
        "mask_us_p50": round(q[49] * 1e6, 1),
        "mask_us_p99": round(q[98] * 1e6, 1),
        "masks": len(mask_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--log-dir", default="/tmp/pdserve-bench-structured")
    args = ap.parse_args()
    import jsonschema

    cases = schemas(args.requests, seed=7, finite=False)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with ServerProcess(pdserve_cmd() + ["serve", "--port", str(port)], port, log_dir / "serve.log") as srv:
        srv.wait_ready(timeout=600)
        warm = [_body(16, temperature=0)] * args.streams
        asyncio.run(_pass(srv.url, warm, args.streams))
        constrained = [
            _body(
                args.max_tokens,
                temperature=1.0,
                seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": s}},
            )
            for i, s in enumerate(cases)
        ]
        with_schema = asyncio.run(_pass(srv.url, constrained, args.streams))
        free = [
            _body(r["tokens"], temperature=1.0, seed=i, ignore_eos=True) for i, r in enumerate(with_schema)
        ]
        baseline = asyncio.run(_pass(srv.url, free, args.streams))
    valid, cut = 0, 0
    for r, s in zip(with_schema, cases):
        try:
            jsonschema.validate(json.loads(r["text"]), s)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            # An output max_tokens cut short is not a whole document; anything else is a fault.
            cut += r["finish_reason"] == "length"
            print(f"invalid ({r['finish_reason']}): {r['text'][:300]!r}: {str(e)[:200]}", file=sys.stderr)
    tpot_c = statistics.median(r["tpot"] for r in with_schema if r["tpot"])
    tpot_b = statistics.median(r["tpot"] for r in baseline if r["tpot"])
    result = {
        "benchmark": "structured_outputs",
        "cpu": describe(),
        "deployment": "pdserve serve (PD, 1 prefill + 1 decode), smollm2-135m",
        "streams": args.streams,
        "requests": args.requests,
        "valid": f"{valid}/{len(cases)}",
        "invalid_cut_by_max_tokens": cut,
        "tokens_per_request_p50": statistics.median(r["tokens"] for r in with_schema),
        "tpot_ms_p50_constrained": round(tpot_c * 1e3, 2),
        "tpot_ms_p50_baseline": round(tpot_b * 1e3, 2),
        "tpot_ratio": round(tpot_c / tpot_b, 3),
        "goal": "<= 1.15",
        "grammar_engines": _mask_times([r["text"] for r in with_schema], cases),
    }
    print(json.dumps(result))
    return 0 if valid + cut == len(cases) and tpot_c / tpot_b <= 1.15 else 1


if __name__ == "__main__":
    sys.exit(main())
