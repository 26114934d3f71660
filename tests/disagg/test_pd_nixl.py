"""transfer.backend: nixl (optional extra): one-sided writes through NIXL agents over UCX. Skipped
when the package is not installed.

Greedy outputs of prefill + decode engines over nixl must equal the mixed engine's, the KV must not
travel over the tcp fallback, a job whose writes cannot start fails (the decode worker then
prefills locally), and both pools must return to their starting state.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("UCX_MODULES", "^efa")       # before UCX loads: else a segfault at exit
pytest.importorskip("nixl._api", reason="the nixl extra is not installed (pip install 'pdserve[nixl]')",
                    exc_type=ImportError)      # ImportError too: a wheel whose libraries fail to load

from pdserve import SamplingParams  # noqa: E402
from pdserve.config import load_config  # noqa: E402
from pdserve.disagg.transport import NixlEndpoint, NixlWriter  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.server.roles import build_engine  # noqa: E402

# Not tiny-llama: its greedy output repeats the first token whatever the KV holds.
MODEL = "tiny-qwen2"


def _sibling(name: str):
    # The in-process engine loop of test_pd_engines.py, loaded without making tests/ a package.
    spec = importlib.util.spec_from_file_location(f"pdserve_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_pd = _sibling("test_pd_engines")
Loop, _prompts = _pd.Loop, _pd._prompts


def _config(role: str, **disagg):
    return load_config(None, {"model.name": MODEL, "cache.device_blocks": 256, "cache.block_size": 4,
                              "scheduler.max_num_batched_tokens": 16, "worker.role": role,
                              "transfer.backend": "nixl", "disagg.local_prefill_max_tokens": 8,
                              **{f"disagg.{k}": v for k, v in disagg.items()}})


def _mixed_outputs(prompts, params) -> dict[str, list[int]]:
    mixed = LLMEngine(_config("mixed"))
    for i, p in enumerate(prompts):
        mixed.add_request(f"r{i}", p, params)
    want: dict[str, list[int]] = {}
    while mixed.has_unfinished():
        for out in mixed.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)
    return want


def test_writer_places_runs_in_the_remote_pool_and_fails_loudly():
    bs, row = 4, 2 * 8 * 4
    src = np.random.default_rng(0).integers(0, 256, (3, 2, 16 * bs, 2, 8 * 4), dtype=np.uint8)
    dst = np.zeros((3, 2, 24 * bs, 2, 8 * 4), dtype=np.uint8)
    remote, local = NixlEndpoint("test-decode", dst), NixlEndpoint("test-prefill", src)
    try:
        w = NixlWriter(src, bs, local, remote.metadata, remote.base, [3, 2, 24 * bs, 2, 8], 4)
        runs = [(0, 5, 2), (7, 20, 3)]
        for layer in range(3):
            assert w.write_layer("x", layer, runs) == 2 * (2 + 3) * bs * row
        assert w.flush() and not w.flush()      # waited for the writes once, nothing left after
        want = np.zeros_like(dst)
        for s, d, k in runs:
            want[:, :, d * bs:(d + k) * bs] = src[:, :, s * bs:(s + k) * bs]
        assert np.array_equal(dst, want)
        with pytest.raises(ValueError):
            w.write_layer("x", 0, [(0, 23, 2)])            # past the end of the remote pool
        bad = NixlWriter(src, bs, local, remote.metadata, remote.base + dst.nbytes, [3, 2, 24 * bs, 2, 8], 4)
        with pytest.raises(Exception, match="NOT_FOUND"):  # outside what the peer registered
            bad.write_layer("x", 0, runs)
    finally:
        remote.close()
        local.close()


def test_pd_nixl_equals_mixed():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(10) + [_prompts(6)[5][:6]]          # the last one is short: prefilled locally
    want = _mixed_outputs(prompts, params)
    prefill = Loop(build_engine(_config("prefill")))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[prefill.engine.connector.endpoint])))
    try:
        for i, p in enumerate(prompts):
            decode.submit(lambda e, i=i, p=p: e.add_request(f"r{i}", p, params))
        decode.wait(want)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 10 and s["kv_transfers_failed_total"] == 0
        assert s["kv_recv_tcp_bytes_total"] == 0              # every byte came through NIXL
        sent = prefill.engine.stats()["kv_send_bytes_total"]
        assert sent > 0 and sent == s["kv_transfer_bytes_total"]
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        decode.stop()
        prefill.stop()


def test_unusable_peer_metadata_fails_the_job_and_decode_prefills_locally():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = _prompts(4)[3]
    want = _mixed_outputs([prompt], params)["r0"]
    prefill = Loop(build_engine(_config("prefill")))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[prefill.engine.connector.endpoint],
                                       quarantine_timeout_s=120)))
    try:
        decode.engine.connector.pool_endpoint.metadata = b"not nixl metadata"
        decode.submit(lambda e: e.add_request("a", prompt, params))
        decode.wait(["a"])
        assert decode.outputs["a"] == want
        s = decode.engine.stats()
        assert (s["kv_transfers_failed_total"], s["kv_transfers_completed_total"]) == (1, 0)
        assert s["kv_local_prefill_fallbacks_total"] == 1
        assert prefill.engine.stats()["kv_prefill_jobs_failed_total"] == 1
        decode.wait_idle()                  # released by the cancel ack, well before the 120 s quarantine
        prefill.wait_idle()
        assert decode.engine.stats()["kv_blocks_quarantined"] == 0
    finally:
        decode.stop()
        prefill.stop()
