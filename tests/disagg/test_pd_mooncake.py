"""transfer.backend: mooncake (optional extra): one-sided writes through Mooncake's transfer engine
(TCP transport, P2P handshake). Skipped when the package is not installed.

Greedy outputs of prefill + decode engines over mooncake must equal the mixed engine's, the KV must
not travel over the tcp fallback, a failed write must fail the job (the decode worker then
prefills locally), and both pools must return to their starting state.
"""
from __future__ import annotations


import numpy as np
import pytest

# ImportError, not only ModuleNotFoundError: an installed wheel without libibverbs1 fails to load.
pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed (pip install 'pdserve[mooncake]')",
                    exc_type=ImportError)

from pdserve import SamplingParams  # noqa: E402
from pdserve.disagg.transport import MooncakeEndpoint, MooncakeWriter  # noqa: E402
from pdserve.server.roles import build_engine  # noqa: E402
from pd_harness import Loop, mixed_outputs, pd_config, prompts  # noqa: E402


def _config(role: str, **disagg):
    return pd_config(role, "mooncake", device_blocks=256, **disagg)


def test_writer_places_runs_in_the_remote_pool_and_fails_loudly():
    """Byte-exact placement of runs between pools with different slot counts; a write the remote
    side rejects raises (the sender thread turns that into a failed job)."""
    bs, row = 4, 2 * 8 * 4                     # block size, bytes per slot (2 heads x 8 dims x float32)
    src = np.random.default_rng(0).integers(0, 256, (3, 2, 16 * bs, 2, 8 * 4), dtype=np.uint8)
    dst = np.zeros((3, 2, 24 * bs, 2, 8 * 4), dtype=np.uint8)
    remote, local = MooncakeEndpoint("127.0.0.1", dst), MooncakeEndpoint("127.0.0.1", src)
    try:
        w = MooncakeWriter(src, bs, local, remote.session_id, remote.base, [3, 2, 24 * bs, 2, 8], 4)
        runs = [(0, 5, 2), (7, 20, 3)]
        for layer in range(3):
            assert w.write_layer("x", layer, runs) == 2 * (2 + 3) * bs * row
        want = np.zeros_like(dst)
        for s, d, k in runs:
            want[:, :, d * bs:(d + k) * bs] = src[:, :, s * bs:(s + k) * bs]
        assert np.array_equal(dst, want)
        with pytest.raises(ValueError):
            w.write_layer("x", 0, [(0, 23, 2)])            # past the end of the remote pool
        remote.close()                                     # unregistered: the peer rejects writes
        with pytest.raises(RuntimeError, match="Mooncake write"):
            w.write_layer("x", 0, runs)
    finally:
        remote.close()
        local.close()


def test_pd_mooncake_equals_mixed():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt_list = prompts(10) + [prompts(6)[5][:6]]          # the last one is short: prefilled locally
    want = mixed_outputs(prompt_list, params)
    prefill = Loop(build_engine(_config("prefill")))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[prefill.engine.connector.endpoint])))
    try:
        for i, p in enumerate(prompt_list):
            decode.submit(lambda e, i=i, p=p: e.add_request(f"r{i}", p, params))
        decode.wait(want)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 10 and s["kv_transfers_failed_total"] == 0
        assert s["kv_recv_tcp_bytes_total"] == 0              # every byte came through Mooncake
        sent = prefill.engine.stats()["kv_send_bytes_total"]
        assert sent > 0 and sent == s["kv_transfer_bytes_total"]
        decode.wait_idle()
        prefill.wait_idle()
    finally:
        decode.stop()
        prefill.stop()


def test_rejected_write_fails_the_job_and_decode_prefills_locally():
    """The decode pool is no longer registered, so the prefill worker's first write fails: the job
    fails, the blocks are quarantined until the cancel is acknowledged, and the request completes
    by local prefill with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts(4)[3]
    want = mixed_outputs([prompt], params)["r0"]
    prefill = Loop(build_engine(_config("prefill")))
    decode = Loop(build_engine(_config("decode", prefill_endpoints=[prefill.engine.connector.endpoint],
                                       quarantine_timeout_s=120)))
    try:
        mc = decode.engine.connector.pool_endpoint
        assert mc.engine.unregister_memory(mc.base) == 0
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
