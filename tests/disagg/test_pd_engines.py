"""Prefill and decode engines joined by their KV connectors, in one process, over real sockets.

Each engine steps on its own thread, as in a worker. Greedy outputs must equal the mixed engine's,
over shm and tcp, and both pools must return to their starting state on every path.
"""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import load_model_files
from pdserve.server.roles import build_engine

MODEL = "tiny-qwen2"   # tiny-llama's greedy output ignores its KV (it repeats the last token)


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


def _config(role: str, backend: str = "auto", **disagg):
    return load_config(None, {"model.name": MODEL, "cache.device_blocks": 64, "cache.block_size": 4,
                              "scheduler.max_num_batched_tokens": 16, "worker.role": role,
                              "transfer.backend": backend, "disagg.local_prefill_max_tokens": 8,
                              **{f"disagg.{k}": v for k, v in disagg.items()}})


class Loop:
    """Steps an engine on its own thread until stopped."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.lock = threading.Lock()
        self.commands: list = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, fn) -> None:
        with self.lock:
            self.commands.append(fn)

    def _run(self) -> None:
        while not self._stop:
            with self.lock:
                cmds, self.commands = self.commands, []
            for fn in cmds:
                fn(self.engine)
            if not self.engine.has_unfinished():
                time.sleep(0.001)
                continue
            for out in self.engine.step():
                self._record(out)

    def _record(self, out) -> None:
        if out is None:
            return
        self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            self.finished[out.request_id] = out.finish_reason

    def abort(self, rid: str) -> None:
        self.submit(lambda e: self._record(e.abort_request(rid)))

    def wait(self, rids, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(r in self.finished for r in rids):
            assert time.monotonic() < deadline, f"unfinished: {set(rids) - set(self.finished)}"
            time.sleep(0.01)

    def wait_idle(self, timeout=30.0) -> None:
        deadline = time.monotonic() + timeout
        e = self.engine
        while e.has_unfinished() or e.pool.num_free != e.pool.num_blocks:
            assert time.monotonic() < deadline, f"not idle: {e.stats()}"
            time.sleep(0.01)
        e.pool.check_integrity()

    def stop(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        self.engine.connector.close()


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + 5 * i)] for i in range(n)]


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_equals_mixed(loaded, backend):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    mixed = LLMEngine(_config("mixed"), loaded)
    prompts = _prompts(6) + [_prompts(6)[5][:6]]      # the last one is short: prefilled locally
    for i, p in enumerate(prompts):
        mixed.add_request(f"r{i}", p, params)
    want: dict[str, list[int]] = {}
    while mixed.has_unfinished():
        for out in mixed.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)

    prefill = Loop(build_engine(_config("prefill", backend)))
    decode = Loop(build_engine(_config("decode", backend, prefill_endpoints=[prefill.engine.connector.endpoint])))
    try:
        for i, p in enumerate(prompts):
            decode.submit(lambda e, i=i, p=p: e.add_request(f"r{i}", p, params))
        decode.wait(want)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 6 and s["kv_transfers_failed_total"] == 0
        assert prefill.engine.stats()["kv_send_bytes_total"] > 0
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        decode.stop()
        prefill.stop()


def test_silent_prefill_peer_falls_back_to_local(loaded):
    """A peer that accepts connections but never answers: the deadline fires, the request is
    prefilled locally, the quarantined blocks come back."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mixed = LLMEngine(_config("mixed"), loaded)
    prompt = _prompts(3)[2]
    mixed.add_request("a", prompt, params)
    want = []
    while mixed.has_unfinished():
        for out in mixed.step():
            want.extend(out.new_token_ids)
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.PULL)           # binds, never reads
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[f"tcp://127.0.0.1:{port}"],
                                       bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5)))
    try:
        decode.submit(lambda e: e.add_request("a", prompt, params))
        decode.wait(["a"])
        assert decode.outputs["a"] == want
        s = decode.engine.stats()
        assert s["kv_transfers_failed_total"] == 1 and s["kv_local_prefill_fallbacks_total"] == 1
        decode.wait_idle()
        assert decode.engine.stats()["kv_blocks_quarantined"] == 0
    finally:
        decode.stop()
        silent.close(0)


def test_failed_peer_retries_on_next_prefill_worker(loaded):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mixed = LLMEngine(_config("mixed"), loaded)
    prompt = _prompts(4)[3]
    mixed.add_request("a", prompt, params)
    want = []
    while mixed.has_unfinished():
        for out in mixed.step():
            want.extend(out.new_token_ids)
    silent = zmq.Context.instance().socket(zmq.PULL)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    prefill = Loop(build_engine(_config("prefill")))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[f"tcp://127.0.0.1:{port}",
                                                                   prefill.engine.connector.endpoint],
                                       bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5)))
    try:
        decode.submit(lambda e: e.add_request("a", prompt, params))
        decode.wait(["a"])
        assert decode.outputs["a"] == want
        s = decode.engine.stats()
        assert (s["kv_transfers_failed_total"], s["kv_transfers_completed_total"]) == (1, 1)
        assert s["kv_local_prefill_fallbacks_total"] == 0
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        decode.stop()
        prefill.stop()
        silent.close(0)


def test_abort_while_loading_frees_every_block(loaded):
    """A client that goes away while its KV is in flight: the prefill side stops, the decode side
    holds the blocks until the cancel is acknowledged, then both pools are whole again."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefill = Loop(build_engine(load_config(None, {
        "model.name": MODEL, "cache.device_blocks": 256, "cache.block_size": 4, "worker.role": "prefill",
        "scheduler.max_num_batched_tokens": 64, "transfer.bandwidth_limit": 20000})))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[prefill.engine.connector.endpoint])))
    prompt = [(5 * j) % 250 + 1 for j in range(200)]       # 200 tokens x 512 B at 20 kB/s: ~5 s in flight
    try:
        decode.submit(lambda e: e.add_request("a", prompt, params))
        deadline = time.monotonic() + 10
        while decode.engine.stats()["kv_transfers_transferring"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        decode.abort("a")
        decode.wait(["a"])
        assert decode.finished["a"] == "abort"
        decode.wait_idle()
        prefill.wait_idle()
        assert decode.engine.stats()["kv_blocks_quarantined"] == 0
        assert prefill.engine.stats()["kv_prefill_jobs_active"] == 0
    finally:
        decode.stop()
        prefill.stop()


def test_parity_depends_on_the_transferred_kv(loaded, monkeypatch):
    """The control for the parity tests: with the layer writes dropped, outputs differ."""
    from pdserve.disagg import transport
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(4)[1:]
    mixed = LLMEngine(_config("mixed"), loaded)
    for i, p in enumerate(prompts):
        mixed.add_request(f"r{i}", p, params)
    want: dict[str, list[int]] = {}
    while mixed.has_unfinished():
        for out in mixed.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)
    monkeypatch.setattr(transport.ShmWriter, "write_layer", lambda self, rid, layer, runs: 0)
    prefill = Loop(build_engine(_config("prefill", "shm")))
    decode = Loop(build_engine(_config("decode", "shm", prefill_endpoints=[prefill.engine.connector.endpoint])))
    try:
        for i, p in enumerate(prompts):
            decode.submit(lambda e, i=i, p=p: e.add_request(f"r{i}", p, params))
        decode.wait(want)
        assert decode.outputs != want
    finally:
        decode.stop()
        prefill.stop()
