"""A request whose sampling breaks (values a bypassed check let through) in a PD pair: the prefill
engine fails that job alone and tells the decode worker it was the request's own failure, so the
decode worker ends the request with the error (no local retry, the peer not marked down); both
engines go on, the other requests keep the mixed engine's greedy tokens, and both pools return to
their start."""

from __future__ import annotations

import pytest
from pd_harness import MODEL, mixed_outputs, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.model.loader import load_model_files


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


def test_a_request_whose_sampling_breaks_fails_alone_on_both_engines(loaded, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt_list = prompts(3)
    want = mixed_outputs(prompt_list, params, loaded)
    later = [[t % 250 + 2 for t in p] for p in prompt_list]  # not in either prefix cache
    want_later = mixed_outputs(later, params, loaded)
    # Neither engine checks values now: the NaN temperature reaches the prefill worker's sampler.
    monkeypatch.setattr(SamplingParams, "validate", lambda self, vocab_size=None: None)
    bad = SamplingParams(temperature=float("nan"), max_tokens=12, ignore_eos=True)
    with pd_pair() as (prefill, decode):
        decode.submit(lambda e: e.add_request("bad", prompts(4)[3], bad))
        decode.run(prompt_list, params)
        decode.wait(["bad"])
        assert decode.finished["bad"] == "error" and "sampling failed" in decode.errors["bad"]
        assert decode.outputs.get("bad", []) == []
        assert {rid: decode.outputs[rid] for rid in want} == want
        assert prefill.engine.stats()["kv_prefill_jobs_failed_total"] == 1
        # The decode worker ended it: no local prefill that would fail the same way, no other peer
        # tried, and the prefill worker not counted down for a failure that was the request's own.
        s = decode.engine.stats()
        assert s["kv_local_prefill_fallbacks_total"] == 0 and s["prefill_tokens_computed"] == 0
        decode.wait_idle()
        prefill.wait_idle()
        decode.outputs.clear()
        decode.finished.clear()
        done = decode.engine.stats()["kv_transfers_completed_total"]
        decode.run(later, params)  # both engines still serve, through the transfer
        assert decode.outputs == want_later
        assert decode.engine.stats()["kv_transfers_completed_total"] == done + len(later)
        decode.wait_idle()
        prefill.wait_idle()
