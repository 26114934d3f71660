"""Shared by the in-process PD tests: configs, a thread that steps an engine, prompts, and the
mixed engine's greedy outputs to compare against. (pytest puts tests/ on the path.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import zmq

from pdserve import SamplingParams
from pdserve.config import Config, load_config
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import LoadedModel
from pdserve.server.roles import build_engine

MODEL = "tiny-qwen2"  # tiny-llama's greedy output ignores its KV (it repeats the last token)


def pd_config(
    role: str, backend: str = "auto", device_blocks: int = 64, overrides: dict | None = None, **disagg
) -> Config:
    """`overrides`: more config keys ("server.internal_token": ...)."""
    return load_config(
        None,
        {
            "model.name": MODEL,
            "cache.device_blocks": device_blocks,
            "cache.block_size": 4,
            "scheduler.max_num_batched_tokens": 16,
            "worker.role": role,
            "transfer.backend": backend,
            "disagg.local_prefill_max_tokens": 8,
            **{f"disagg.{k}": v for k, v in disagg.items()},
            **(overrides or {}),
        },
    )


class Loop:
    """Steps an engine on its own thread until stopped."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.errors: dict[str, str] = {}  # finish_reason "error": the message for the client
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
        if out.error:
            self.errors[out.request_id] = out.error

    def run(self, prompt_list: list[list[int]], params: SamplingParams) -> None:
        """Submit the prompts as r0, r1, ... and wait until all are finished."""
        for i, p in enumerate(prompt_list):
            self.submit(lambda e, i=i, p=p: e.add_request(f"r{i}", p, params))
        self.wait([f"r{i}" for i in range(len(prompt_list))])

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
        self.engine.close()  # its tier threads, event publisher and encoder processes (their sockets)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + 5 * i)] for i in range(n)]


def mixed_outputs(
    prompt_list: list[list[int]], params: SamplingParams, loaded: LoadedModel | None = None
) -> dict[str, list[int]]:
    """Greedy tokens of the colocated engine, request ids r0, r1, ..."""
    mixed = LLMEngine(pd_config("mixed"), loaded)
    for i, p in enumerate(prompt_list):
        mixed.add_request(f"r{i}", p, params)
    want: dict[str, list[int]] = {}
    while mixed.has_unfinished():
        for out in mixed.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)
    return want


@contextmanager
def pd_pair(
    backend: str = "auto",
    device_blocks: int = 64,
    prefill_config: Config | None = None,
    decode_overrides: dict | None = None,
    peers_before: Sequence[str] = (),
    decode_loop: type[Loop] = Loop,
    **decode_disagg,
) -> Iterator[tuple[Loop, Loop]]:
    """A prefill and a decode engine stepping on their own threads, the decode one pointed at the
    prefill one, after any `peers_before` (`decode_disagg`: more of its disagg config,
    `decode_overrides`: other keys; `decode_loop`: a Loop subclass for it); both stopped afterwards."""
    prefill = Loop(build_engine(prefill_config or pd_config("prefill", backend, device_blocks)))
    try:
        endpoints = [*peers_before, prefill.engine.connector.endpoint]
        decode = decode_loop(
            build_engine(
                pd_config(
                    "decode",
                    backend,
                    device_blocks,
                    decode_overrides,
                    prefill_endpoints=endpoints,
                    **decode_disagg,
                )
            )
        )
        try:
            yield prefill, decode
        finally:
            decode.stop()
    finally:
        prefill.stop()


@contextmanager
def silent_peer() -> Iterator[str]:
    """The endpoint of a KV peer that accepts connections and never answers."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        yield f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    finally:
        sock.close(0)


def check_failed_job_falls_back_to_local(
    prefill: Loop, decode: Loop, prompt: list[int], params: SamplingParams, want: list[int]
) -> None:
    """With the decode pool made unwritable for the transport: the job fails, the request completes
    by local prefill with the same tokens, and the quarantined blocks come back on the cancel ack."""
    decode.submit(lambda e: e.add_request("a", prompt, params))
    decode.wait(["a"])
    assert decode.outputs["a"] == want
    s = decode.engine.stats()
    assert (s["kv_transfers_failed_total"], s["kv_transfers_completed_total"]) == (1, 0)
    assert s["kv_local_prefill_fallbacks_total"] == 1
    assert prefill.engine.stats()["kv_prefill_jobs_failed_total"] == 1
    decode.wait_idle()  # released by the cancel ack, well before a long quarantine
    prefill.wait_idle()
    assert decode.engine.stats()["kv_blocks_quarantined"] == 0
