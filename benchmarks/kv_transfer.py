"""KV transfer speed and layer-wise overlap, measured in one run. Prints one JSON line.

1. Bandwidth: 64 MiB of KV (the default model's geometry: 30 layers, 3 KV heads, head dim 64,
   float32, blocks of 16) moved from this process into a decode pool owned by another process,
   through each transport, divided by memcpy bandwidth measured here. Goal: shm >= 0.5.
   - shm: the real ShmWriter maps the decode process's /dev/shm pool and copies layer by layer;
   - tcp: the real TcpWriter sends zero-copy ZeroMQ frames that the decode process's real
     DecodeConnector receives straight into its blocks; timed until the receiver holds every byte.
   - mooncake (when the optional extra is installed, else null): the decode process registers its
     pool with a Mooncake engine; the real MooncakeWriter writes layer by layer, one batched
     synchronous write each (returning only once the bytes are in the pool).
   - nixl (likewise): the decode process registers its pool with a NIXL agent; the real NixlWriter
     posts one WRITE per layer, timed until flush() has seen every one complete.
2. Overlap: a real prefill engine (SmolLM2, one torch thread) runs a 1024-token prompt for a real
   decode engine over shm. The exposed lag is the time from the last layer's compute to every
   write done; divided by one layer's transfer time (goal <= 1.5). The same prompt with
   `transfer.layerwise: false` (the whole request sent after the forward) is the baseline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BLOCK = 16


def _geometry(mib: int):
    import torch

    from pdserve.cache.kv_cache import bytes_per_block
    from pdserve.model.arch import ModelArch

    arch = ModelArch()  # the default model's shape
    num_blocks = (mib << 20) // bytes_per_block(arch, BLOCK, torch.float32)
    return arch, num_blocks


def _decode_process(mib: int, conn) -> None:
    """Owns the destination pool (in shared memory) and a real DecodeConnector for tcp frames."""
    import torch

    from pdserve.cache.kv_cache import allocate_kv_cache, new_shm_path, raw_bytes_view
    from pdserve.config import load_config
    from pdserve.disagg.receiver import DecodeConnector
    from pdserve.protocol.pd import LayerFrames

    arch, nb = _geometry(mib)
    shm = new_shm_path()
    kv = allocate_kv_cache(arch, nb, BLOCK, torch.float32, "cpu", shm)
    dc = DecodeConnector(load_config(), kv, str(shm), "tcp://127.0.0.1:*")
    info = {"shm": str(shm), "shape": list(kv.shape), "endpoint": dc.endpoint}
    mc = _optional_endpoint("mooncake", raw_bytes_view(kv))
    if mc is not None:
        info.update(mooncake_session=mc.session_id, mooncake_base=mc.base)
    nx = _optional_endpoint("nixl", raw_bytes_view(kv))
    if nx is not None:
        info.update(nixl_metadata=nx.metadata, nixl_base=nx.base)
    conn.send(info)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        rid, expected = cmd
        dc.accept_writes(rid, list(range(nb)))
        got = 0
        while got < expected:
            msg = dc.next_message(timeout=30)
            if msg is None:
                break
            got += msg.received_bytes if isinstance(msg, LayerFrames) else 0
        conn.send(got)
    dc.close()
    for ep in (mc, nx):
        if ep is not None:
            ep.close()


def _optional_endpoint(backend: str, buf):
    """A Mooncake or NIXL endpoint over `buf`, or None when that optional extra is not installed."""
    from pdserve.disagg.transports.mooncake import MooncakeEndpoint
    from pdserve.disagg.transports.nixl import NixlEndpoint

    try:
        if backend == "mooncake":
            return MooncakeEndpoint("127.0.0.1", buf)
        return NixlEndpoint(f"bench-{os.getpid()}", buf)
    except ImportError:
        return None


def bandwidth(mib: int, repeats: int) -> dict:
    import numpy as np
    import torch
    import zmq

    from pdserve.cache.kv_cache import allocate_kv_cache, raw_bytes_view
    from pdserve.disagg.transports.mooncake import MooncakeWriter
    from pdserve.disagg.transports.nixl import NixlWriter
    from pdserve.disagg.transports.shm import ShmWriter
    from pdserve.disagg.transports.tcp import TcpWriter

    arch, nb = _geometry(mib)
    src_t = allocate_kv_cache(arch, nb, BLOCK, torch.float32)
    src_t.normal_()
    src = raw_bytes_view(src_t)
    total = src.nbytes
    a, b = np.ones(total, dtype=np.uint8), np.empty(total, dtype=np.uint8)
    np.copyto(b, a)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    memcpy = total / best(lambda: np.copyto(b, a))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_process, args=(mib, child), daemon=True)
    proc.start()
    info = parent.recv()
    runs = [(0, 0, nb)]
    shm_w = ShmWriter(src, BLOCK, info["shm"], info["shape"], 4)
    shm = total / best(lambda: [shm_w.write_layer("bench", layer, runs) for layer in range(arch.num_layers)])
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(info["endpoint"])
    tcp_w = TcpWriter(src, BLOCK, sock)

    def tcp_once() -> None:
        parent.send(("bench", total))
        for layer in range(arch.num_layers):
            tcp_w.write_layer("bench", layer, runs)
        tcp_w.flush()
        got = parent.recv()
        assert got == total, f"receiver got {got} of {total} bytes"

    tcp_once()  # connect and warm up
    tcp = total / best(tcp_once)
    one_sided: dict[str, float | None] = {"mooncake": None, "nixl": None}
    for backend in one_sided:
        local = _optional_endpoint(backend, src) if f"{backend}_base" in info else None
        if local is None:
            continue
        if backend == "mooncake":
            w = MooncakeWriter(
                src, BLOCK, local, info["mooncake_session"], info["mooncake_base"], info["shape"], 4
            )
        else:
            w = NixlWriter(src, BLOCK, local, info["nixl_metadata"], info["nixl_base"], info["shape"], 4)

        def once(w=w) -> None:
            for layer in range(arch.num_layers):
                w.write_layer("bench", layer, runs)
            w.flush()

        shm_w.dst.fill(0)  # the same pool, mapped: check that every byte landed in place
        once()  # handshake and warm up
        assert np.array_equal(shm_w.dst, src), f"the {backend} writes did not land in the decode pool"
        one_sided[backend] = total / best(once)
        local.close()
    parent.send("stop")
    proc.join(timeout=10)
    sock.close(0)
    return {
        "bytes": total,
        "memcpy_gbps": round(memcpy / 1e9, 2),
        "shm_gbps": round(shm / 1e9, 2),
        "shm_ratio": round(shm / memcpy, 3),
        "tcp_gbps": round(tcp / 1e9, 2),
        "tcp_ratio": round(tcp / memcpy, 3),
        **{
            f"{k}_{unit}": None if v is None else round(v / div, nd)
            for k, v in one_sided.items()
            for unit, div, nd in (("gbps", 1e9, 2), ("ratio", memcpy, 3))
        },
    }


class _Loop:
    def __init__(self, engine) -> None:
        self.engine, self.finished, self.commands, self.stop = engine, {}, [], False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop:
            while self.commands:
                self.commands.pop(0)(self.engine)
            if not self.engine.has_unfinished():
                time.sleep(0.001)
                continue
            for out in self.engine.step():
                if out.finished:
                    self.finished[out.request_id] = out


def overlap(prompt_len: int, repeats: int) -> dict:
    import torch

    from pdserve import SamplingParams
    from pdserve.config import load_config
    from pdserve.model.loader import load_model_files
    from pdserve.server.roles import build_engine

    torch.set_num_threads(1)
    loaded = load_model_files("smollm2-135m")
    common = {
        "cache.prefix_cache": False,
        "cache.device_blocks": 256,
        "server.threads": 1,
        "scheduler.max_num_batched_tokens": prompt_len,
        "transfer.backend": "shm",
        "disagg.local_prefill_max_tokens": 1,
    }
    prefill_engine = build_engine(load_config(None, {**common, "worker.role": "prefill"}), loaded)
    decode_engine = build_engine(
        load_config(
            None,
            {
                **common,
                "worker.role": "decode",
                "disagg.prefill_endpoints": [prefill_engine.connector.endpoint],
            },
        ),
        loaded,
    )
    pl, dl = _Loop(prefill_engine), _Loop(decode_engine)
    conn = prefill_engine.connector
    params = SamplingParams(temperature=0, max_tokens=1)
    out: dict[str, list[float]] = {"layerwise": [], "whole": [], "layer": []}
    n = 0
    for _ in range(repeats):
        for mode in ("layerwise", "whole"):
            conn.layerwise = mode == "layerwise"
            before = conn.stats()
            rid = f"r{n}"
            n += 1
            prompt = [(37 * n + 11 * j) % 40000 + 100 for j in range(prompt_len)]
            dl.commands.append(lambda e, rid=rid, prompt=prompt: e.add_request(rid, prompt, params))
            deadline = time.monotonic() + 120
            while rid not in dl.finished:
                if time.monotonic() > deadline:
                    raise RuntimeError("the request did not finish")
                time.sleep(0.005)
            after = conn.stats()
            d = {k: after[k] - before[k] for k in after if k.endswith("_total")}
            out[mode].append(d["kv_send_tail_lag_seconds_total"] / max(1, d["kv_send_steps_total"]))
            out["layer"].append(d["kv_send_seconds_total"] / max(1, d["kv_send_layers_total"]))
    pl.stop = dl.stop = True
    time.sleep(0.05)
    prefill_engine.connector.close()
    decode_engine.connector.close()
    layer = statistics.median(out["layer"])
    lw, whole = statistics.median(out["layerwise"]), statistics.median(out["whole"])
    assert decode_engine.stats()["kv_transfers_completed_total"] == 2 * repeats
    return {
        "prompt_tokens": prompt_len,
        "layer_transfer_ms": round(layer * 1e3, 3),
        "layerwise_lag_ms": round(lw * 1e3, 3),
        "overlap_ratio": round(lw / layer, 2),
        "whole_request_lag_ms": round(whole * 1e3, 3),
        "whole_request_ratio": round(whole / layer, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1024)
    a = p.parse_args(argv)
    result = {
        "bench": "kv_transfer",
        **bandwidth(a.mib, a.repeats),
        **overlap(a.prompt_len, max(1, a.repeats // 2)),
        "goal_shm_ratio": 0.5,
        "goal_overlap_ratio": 1.5,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
