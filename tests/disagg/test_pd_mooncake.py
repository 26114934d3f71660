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
pytest.importorskip(
    "mooncake.engine",
    reason="the mooncake extra is not installed (pip install 'pdserve[mooncake]')",
    exc_type=ImportError,
)

from pd_harness import check_failed_job_falls_back_to_local, mixed_outputs, pd_pair, prompts  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.disagg.transports.mooncake import MooncakeEndpoint, MooncakeWriter  # noqa: E402


def test_writer_places_runs_in_the_remote_pool_and_fails_loudly():
    """Byte-exact placement of runs between pools with different slot counts; a write the remote
    side rejects raises (the sender thread turns that into a failed job)."""
    bs, row = 4, 2 * 8 * 4  # block size, bytes per slot (2 heads x 8 dims x float32)
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
            want[:, :, d * bs : (d + k) * bs] = src[:, :, s * bs : (s + k) * bs]
        assert np.array_equal(dst, want)
        with pytest.raises(ValueError):
            w.write_layer("x", 0, [(0, 23, 2)])  # past the end of the remote pool
        remote.close()  # unregistered: the peer rejects writes
        with pytest.raises(RuntimeError, match="Mooncake write"):
            w.write_layer("x", 0, runs)
    finally:
        remote.close()
        local.close()


def test_pd_mooncake_equals_mixed():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt_list = prompts(10) + [prompts(6)[5][:6]]  # the last one is short: prefilled locally
    want = mixed_outputs(prompt_list, params)
    with pd_pair("mooncake", 256) as (prefill, decode):
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 10 and s["kv_transfers_failed_total"] == 0
        assert s["kv_recv_tcp_bytes_total"] == 0  # every byte came through Mooncake
        sent = prefill.engine.stats()["kv_send_bytes_total"]
        assert sent > 0 and sent == s["kv_transfer_bytes_total"]
        decode.wait_idle()
        prefill.wait_idle()


def test_rejected_write_fails_the_job_and_decode_prefills_locally():
    """The decode pool is no longer registered, so the prefill worker's first write fails: the job
    fails, the blocks are quarantined until the cancel is acknowledged, and the request completes
    by local prefill with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts(4)[3]
    want = mixed_outputs([prompt], params)["r0"]
    with pd_pair("mooncake", 256, quarantine_timeout_s=120) as (prefill, decode):
        mc = decode.engine.connector.pool_endpoint
        assert mc.engine.unregister_memory(mc.base) == 0
        check_failed_job_falls_back_to_local(prefill, decode, prompt, params, want)
