"""How much slower a worker's step runs while another worker computes on another core of the machine.

Workers of one machine share its memory system: a memory-bound decode step slows when a GEMM runs
beside it (docs/benchmarks.md: up to 2x on 2 cores), and a prefill step slows less. `pdserve profile`
times a decode step (batch 1) and a prefill step (one chunk of 128) alone and with a neighbour thread
on another core running the other role's kind of work (large GEMMs beside the decode, weight-streaming
matrix-vector products beside the prefill), in a process of its own as a worker is; the ratios go into StepCosts (contended_decode,
contended_prefill), and the simulator applies them to a step that starts while another worker is busy.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Callable

STEPS = 8


def _neighbour_loop(kind: str, hidden: int, ready, stop) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "gemm":  # a prefill's kind of work: compute-bound
        a, b = torch.randn(256, hidden), torch.randn(hidden, 4 * hidden)
    else:  # a decode's: streaming weights, 128 MB a product
        a, b = torch.randn(2, 4096), torch.randn(4096, 8192)
    ready.set()
    while not stop.is_set():
        torch.mm(a, b)


class _Neighbour:
    """Another process (as another worker is) computing on one thread until stopped."""

    def __init__(self, kind: str, hidden: int) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.stop = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(
            target=_neighbour_loop, args=(kind, hidden, self.ready, self.stop), daemon=True
        )

    def __enter__(self) -> "_Neighbour":
        self.proc.start()
        if not self.ready.wait(timeout=120):
            self.proc.kill()
            raise RuntimeError("the neighbour process did not start within 120 s")
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def _timed_steps(engine, make: Callable[[int], list[str]], steps: int, skip: int = 0) -> float:
    """The least time of `steps` engine steps of the requests `make(i)` adds (i counts the batches),
    leaving out the first `skip` steps of each batch (a decode's prompt)."""
    times: list[float] = []
    i = 0
    while len(times) < steps:
        ids = make(i)
        i += 1
        n = 0
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            if n >= skip:
                times.append(time.perf_counter() - t)
            n += 1
        for rid in ids:
            engine.abort_request(rid)
    return min(times)  # other load on the machine only adds


def neighbour_slowdown(engine, prompt: list[int], vocab: int, chunk: int = 128) -> tuple[float, float]:
    """(decode, prefill): least step time with a neighbour computing / alone (at least 1)."""
    import dataclasses

    from pdserve import SamplingParams

    hidden = int(engine.arch.hidden_size)
    sched = engine.scheduler
    base = sched.cfg

    # Every request of every timing its own prompt: one seen before (the alone timing's, in the
    # neighbour's) would hit the prefix cache and time a shorter step.
    fresh = itertools.count()

    def unique(tokens: list[int]) -> tuple[int, list[int]]:
        k = next(fresh)
        return k, [(t + k * 7919) % (vocab - 3) + 3 for t in tokens]

    def decode_batch(i: int) -> list[str]:
        k, ids = unique(prompt[:16])
        rid = f"profile-contention-decode-{k}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=STEPS, ignore_eos=True, detokenize=False))
        return [rid]

    def prefill_chunk(i: int) -> list[str]:
        k, ids = unique(prompt[: chunk * 2])
        rid = f"profile-contention-prefill-{k}"
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
        )  # a chunk a step
        return [rid]

    sched.cfg = dataclasses.replace(base, max_num_batched_tokens=chunk)
    try:
        decode_alone = _timed_steps(engine, decode_batch, STEPS, skip=1)
        with _Neighbour("gemm", hidden):
            decode_beside = _timed_steps(engine, decode_batch, STEPS, skip=1)
        prefill_alone = _timed_steps(engine, prefill_chunk, 4)
        with _Neighbour("stream", hidden):
            prefill_beside = _timed_steps(engine, prefill_chunk, 4)
    finally:
        sched.cfg = base
    return max(1.0, decode_beside / decode_alone), max(1.0, prefill_beside / prefill_alone)
