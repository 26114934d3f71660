"""`pdserve profile`: this machine's engine step costs for the configured model, as a StepCosts file.

It runs the real engine (LLMEngine, the role's threads and quantization) in this process and times
engine.step() itself, which is what a worker's engine thread repeats:
- prefill: one prompt of unique tokens in chunks of T (the step budget); step k computes T tokens
  at context k*T, so one prompt gives a whole row of the grid;
- decode: B requests sharing one prompt of C tokens (the prefix cache computes it once), timed over
  steps where all B decode a token each;
- KV transfer: K and V of N tokens copied by the configured transport's real writer into a second
  pool (shm: mapped from /dev/shm; tcp: ZeroMQ frames into a DecodeConnector's blocks).
A decode figure is the median of its steps and a prefill row a line through all of its steps: the
simulator adds steps up, so it needs a step's typical time. (The least of them, tried before, sat
below the steps of a served run by 20-30%: on a shared 2-core machine a batch-1 step of SmolLM2
moved between ~75 and ~110 ms from second to second within one process, traced.)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.config import Config, derive, for_role
from pdserve.planner.step_costs import Grid, StepCosts
from pdserve.utils.cpu import describe


@dataclass(frozen=True)
class ProfileGrid:
    # Every power of two from 32 to 512: a step's time is convex in its tokens (attention within the
    # chunk), so a line between 128 and 512 put a served 320-token step 16% above its traced time.
    prefill_chunks: tuple[int, ...] = (32, 64, 128, 256, 512)
    prefill_contexts: tuple[int, ...] = (0, 512, 1024)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_contexts: tuple[int, ...] = (32, 512, 1024)
    transfer_tokens: tuple[int, ...] = (64, 256, 1024)
    decode_steps: int = 9
    # Passes over the whole grid, each point's steps pooled across them: a VM's speed drifts from one
    # minute to the next, and with one pass the profiles of a single day disagreed enough to move every
    # plan_accuracy prediction (docs/benchmarks.md).
    passes: int = 3


QUICK = ProfileGrid(
    prefill_chunks=(16, 64),
    prefill_contexts=(0, 64),
    decode_batches=(1, 4),
    decode_contexts=(16, 64),
    transfer_tokens=(16, 64),
    decode_steps=2,
    passes=1,
)


def _engine(config: Config, role: str, grid: ProfileGrid):
    from pdserve.deployment_plan import PD_ROLES, pd_kv_dtype
    from pdserve.engine.engine import LLMEngine

    cfg = for_role(config, role)
    max_batch = max(grid.decode_batches)
    # Role "mixed": the engine alone, without a connector (nothing to send or receive while timing),
    # its KV in the dtype the role's workers keep.
    cfg = derive(
        cfg,
        {
            "cache.kv_dtype": pd_kv_dtype(config) if role in PD_ROLES else cfg.cache.kv_dtype,
            "worker.role": "mixed",
            "cache.prefix_cache": True,
            "cache.swap_space_gb": 0.0,
            "cache.host_cache_gb": 0.0,
            "cache.disk_cache_dir": None,
            "cache.remote": None,
            "cache.kv_events_endpoint": None,
            "scheduler.max_num_seqs": max(max_batch, cfg.scheduler.max_num_seqs),
            "scheduler.max_num_batched_tokens": max(max(grid.prefill_chunks), max_batch),
        },
    )
    engine = LLMEngine(cfg)
    return engine.config, engine  # model.quantization resolved (auto: as the weights are stored)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


def _prefill_grid(
    engine, grid: ProfileGrid, rng: random.Random, vocab: int, log: Callable[[str], None]
) -> Grid:
    """Each row from every step of its prompts: a step's time is close to linear in its context (the
    attention part), so a line through all of them is steadier than one step per grid point. One
    prompt a row in each pass over the grid (see ProfileGrid.passes)."""
    from pdserve import SamplingParams

    sched = engine.scheduler
    base = sched.cfg
    top = max(grid.prefill_contexts)
    points: dict[int, tuple[list[float], list[float]]] = {c: ([], []) for c in grid.prefill_chunks}
    for rep in range(grid.passes):
        for chunk in grid.prefill_chunks:
            ctxs, times = points[chunk]
            sched.cfg = dataclasses.replace(base, max_num_batched_tokens=chunk)
            try:
                prompt = [rng.randrange(3, vocab) for _ in range(top + chunk)]
                rid = f"profile-prefill-{chunk}-{rep}"
                engine.add_request(
                    rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
                )
                ctx = 0
                while engine.has_unfinished():
                    t = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - t)
                    ctxs.append(ctx)
                    ctx += chunk
            finally:
                sched.cfg = base
    rows = []
    for chunk in grid.prefill_chunks:
        ctxs, times = points[chunk]
        a, b = _line(ctxs, times) if len(set(ctxs)) > 1 else (statistics.median(times), 0.0)
        row = [max(a + b * c, min(times)) for c in grid.prefill_contexts]
        rows.append(row)
        log(
            f"prefill chunk {chunk}: "
            + ", ".join(f"ctx {c} {s * 1000:.1f} ms" for c, s in zip(grid.prefill_contexts, row))
        )
    return Grid(list(grid.prefill_chunks), list(grid.prefill_contexts), rows)


def _decode_grid(
    engine, grid: ProfileGrid, rng: random.Random, vocab: int, log: Callable[[str], None]
) -> Grid:
    from pdserve import SamplingParams

    # One prompt per context, shared by every batch: the prefix cache computes it once.
    prompts = {ctx: [rng.randrange(3, vocab) for _ in range(ctx)] for ctx in grid.decode_contexts}
    times: dict[tuple[int, int], list[float]] = {
        (b, c): [] for b in grid.decode_batches for c in grid.decode_contexts
    }
    for rep in range(grid.passes):
        for batch in grid.decode_batches:
            for ctx in grid.decode_contexts:
                p = SamplingParams(max_tokens=grid.decode_steps + 8, ignore_eos=True, detokenize=False)
                ids = [f"profile-decode-{batch}-{ctx}-{rep}-{i}" for i in range(batch)]
                for rid in ids:
                    engine.add_request(rid, prompts[ctx], p)
                reqs = [engine.requests[rid] for rid in ids]
                while any(not r.output_token_ids for r in reqs):
                    engine.step()
                for _ in range(grid.decode_steps):
                    t = time.perf_counter()
                    engine.step()
                    times[batch, ctx].append(time.perf_counter() - t)
                for rid in ids:
                    engine.abort_request(rid)
                while engine.has_unfinished():
                    engine.step()
    rows = [[statistics.median(times[b, c]) for c in grid.decode_contexts] for b in grid.decode_batches]
    for batch, row in zip(grid.decode_batches, rows):
        log(
            f"decode batch {batch}: "
            + ", ".join(f"ctx {c} {s * 1000:.1f} ms" for c, s in zip(grid.decode_contexts, row))
        )
    return Grid(list(grid.decode_batches), list(grid.decode_contexts), rows)


def _transfer(
    cfg: Config, engine, grid: ProfileGrid, log: Callable[[str], None]
) -> tuple[str, list[int], list[float]]:
    """(transport, bytes, seconds) of one transfer of N tokens' KV per grid point, with the real writers."""
    from pdserve.cache.kv_cache import allocate_kv_cache, new_shm_path, raw_bytes_view
    from pdserve.disagg.transports import coalesce
    from pdserve.disagg.transports.shm import ShmWriter

    backend = cfg.transfer.backend
    transport = "shm" if backend in ("auto", "shm") else backend
    if transport not in ("shm", "tcp"):
        raise ValueError(f"pdserve profile measures the shm and tcp transports, not {backend!r}")
    bs = engine.block_size
    src_t = engine.kv_cache
    src = raw_bytes_view(src_t)
    nb = src_t.shape[2] // bs
    path = new_shm_path()
    dst = allocate_kv_cache(engine.arch, nb, bs, src_t.dtype, "cpu", str(path))
    sizes, secs = [], []
    try:
        if transport == "shm":
            w = ShmWriter(src, bs, str(path), list(dst.shape), src_t.element_size())

            def send(runs: list) -> None:
                for layer in range(src.shape[0]):
                    w.write_layer("profile", layer, runs)

            closer: Callable[[], None] = w.close
        else:
            send, closer = _tcp_sender(cfg, src, dst, str(path), bs)
        for n in grid.transfer_tokens:
            blocks = list(range(min(nb, -(-n // bs))))
            runs = coalesce(blocks, blocks)
            send(runs)  # warm up
            times = []
            for _ in range(3 * grid.passes):
                t = time.perf_counter()
                send(runs)
                times.append(time.perf_counter() - t)
            nbytes = len(blocks) * bs * engine_bytes_per_token(engine)
            sizes.append(nbytes)
            secs.append(statistics.median(times))
            log(f"transfer {transport} {nbytes / 1e6:.2f} MB: {secs[-1] * 1000:.2f} ms")
        closer()
    finally:
        del dst
        path.unlink(missing_ok=True)
    return transport, sizes, secs


def _tcp_sender(cfg: Config, src, dst, shm: str, bs: int):
    import zmq

    from pdserve.disagg.receiver import DecodeConnector
    from pdserve.disagg.transports.tcp import TcpWriter
    from pdserve.protocol.pd import LayerFrames

    dc = DecodeConnector(cfg, dst, shm, "tcp://127.0.0.1:*")
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(dc.endpoint)
    w = TcpWriter(src, bs, sock)
    count = [0]

    def send(runs: list) -> None:
        count[0] += 1
        rid = f"profile-{count[0]}"
        blocks = [d + i for _, d, k in runs for i in range(k)]
        dc.accept_writes(rid, blocks)
        expected = sum(w.write_layer(rid, i, runs) for i in range(src.shape[0]))
        w.flush()
        got = 0
        while got < expected:
            msg = dc.next_message(timeout=30)
            if msg is None:
                raise RuntimeError("the tcp receiver took no KV within 30 s")
            got += msg.received_bytes if isinstance(msg, LayerFrames) else 0

    def close() -> None:
        sock.close(0)
        dc.close()

    return send, close


def engine_bytes_per_token(engine) -> int:
    kv = engine.kv_cache  # [layers, 2, slots, kv heads, head dim]
    return int(kv[:, :, :1].numel() * kv.element_size())


def profile(
    config: Config, role: str = "decode", grid: ProfileGrid | None = None, log: Callable[[str], None] = print
) -> StepCosts:
    """Measure and return this machine's StepCosts for `config` as a worker of `role` runs it."""
    grid = grid or ProfileGrid()
    cfg, engine = _engine(config, role, grid)
    try:
        rng = random.Random(0)
        vocab = int(engine.arch.vocab_size)
        log(
            f"profiling {cfg.model.name} ({cfg.model.dtype}, quantization {cfg.model.quantization}, "
            f"{cfg.server.threads} threads) on {describe()}"
        )
        _decode_grid(
            engine,
            dataclasses.replace(
                grid,
                decode_batches=grid.decode_batches[:1],
                decode_contexts=grid.decode_contexts[:1],
                passes=1,
            ),
            rng,
            vocab,
            lambda s: None,
        )  # warm up: first steps pay allocations
        prefill = _prefill_grid(engine, grid, rng, vocab, log)
        decode = _decode_grid(engine, grid, rng, vocab, log)
        transport, sizes, secs = _transfer(cfg, engine, grid, log)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = int(cfg.server.threads or 1)
        contended = (1.0, 1.0)
        if cores >= 2 * threads:  # room for a neighbour on cores of its own
            from pdserve.planner.contention import neighbour_slowdown

            contended = neighbour_slowdown(engine, [rng.randrange(3, vocab) for _ in range(512)], vocab)
            log(
                f"beside a busy neighbour: decode steps x{contended[0]:.2f}, prefill steps x{contended[1]:.2f}"
            )
        return StepCosts(
            cpu=describe(),
            cores=cores,
            model=cfg.model.name,
            dtype=cfg.model.dtype,
            quantization=cfg.model.quantization,
            threads=threads,
            block_size=engine.block_size,
            num_layers=int(engine.arch.num_layers),
            kv_bytes_per_token=engine_bytes_per_token(engine),
            prefill=prefill,
            decode=decode,
            transport=transport,
            transfer_bytes=sizes,
            transfer_seconds=secs,
            layerwise=cfg.transfer.layerwise,
            contended_decode=contended[0],
            contended_prefill=contended[1],
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            notes={"role": role, "grid": dataclasses.asdict(grid)},
        )
    finally:
        engine.close()
