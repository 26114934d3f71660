"""transfer.backend: nixl (optional extra): one-sided writes through NIXL agents over UCX. Skipped
when the package is not installed.

Greedy outputs of prefill + decode engines over nixl must equal the mixed engine's, the KV must not
travel over the tcp fallback, a job whose writes cannot start fails (the decode worker then
prefills locally), and both pools must return to their starting state.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("UCX_MODULES", "^efa")  # before UCX loads: else a segfault at exit
pytest.importorskip(
    "nixl._api", reason="the nixl extra is not installed (pip install 'pdserve[nixl]')", exc_type=ImportError
)  # ImportError too: a wheel whose libraries fail to load

from pd_harness import check_failed_job_falls_back_to_local, mixed_outputs, pd_pair, prompts  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.disagg.transports.nixl import NixlEndpoint, NixlWriter  # noqa: E402


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
        assert w.flush() and not w.flush()  # waited for the writes once, nothing left after
        want = np.zeros_like(dst)
        for s, d, k in runs:
            want[:, :, d * bs : (d + k) * bs] = src[:, :, s * bs : (s + k) * bs]
        assert np.array_equal(dst, want)
        with pytest.raises(ValueError):
            w.write_layer("x", 0, [(0, 23, 2)])  # past the end of the remote pool
        bad = NixlWriter(src, bs, local, remote.metadata, remote.base + dst.nbytes, [3, 2, 24 * bs, 2, 8], 4)
        with pytest.raises(Exception, match="NOT_FOUND"):  # outside what the peer registered
            bad.write_layer("x", 0, runs)
    finally:
        remote.close()
        local.close()


def test_pd_nixl_equals_mixed():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt_list = prompts(10) + [prompts(6)[5][:6]]  # the last one is short: prefilled locally
    want = mixed_outputs(prompt_list, params)
    with pd_pair("nixl", 256) as (prefill, decode):
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 10 and s["kv_transfers_failed_total"] == 0
        assert s["kv_recv_tcp_bytes_total"] == 0  # every byte came through NIXL
        sent = prefill.engine.stats()["kv_send_bytes_total"]
        assert sent > 0 and sent == s["kv_transfer_bytes_total"]
        decode.wait_idle()
        prefill.wait_idle()


def test_unusable_peer_metadata_fails_the_job_and_decode_prefills_locally():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts(4)[3]
    want = mixed_outputs([prompt], params)["r0"]
    with pd_pair("nixl", 256, quarantine_timeout_s=120) as (prefill, decode):
        decode.engine.connector.pool_endpoint.metadata = b"not nixl metadata"
        check_failed_job_falls_back_to_local(prefill, decode, prompt, params, want)
