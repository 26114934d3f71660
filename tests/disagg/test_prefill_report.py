"""The decode worker tells the router who prefilled each request: its first output names the prefill
worker whose KV it holds and the ones that failed the job (the router keeps each prefill worker's
load and circuit breaker from this). Real engines on their threads, over real sockets."""

from __future__ import annotations

from pd_harness import Loop, pd_config, pd_pair, prompts, silent_peer

from pdserve import SamplingParams
from pdserve.server.roles import build_engine

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class FirstOutputs(Loop):
    """A Loop that keeps each request's first output object."""

    def __init__(self, engine) -> None:
        self.first: dict = {}
        super().__init__(engine)

    def _record(self, out) -> None:
        if out is not None and out.new_token_ids:
            self.first.setdefault(out.request_id, out)
        super()._record(out)


def test_the_first_output_names_the_prefill_worker_and_those_that_failed():
    with (
        silent_peer() as dead,
        pd_pair(
            peers_before=[dead], decode_loop=FirstOutputs, bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5
        ) as (prefill, decode),
    ):
        good = prefill.engine.connector.endpoint
        long_prompt, short_prompt = prompts(4)[3], prompts(1)[0][:6]
        decode.submit(lambda e: e.add_request("a", long_prompt, PARAMS))  # dead first, then good
        decode.wait(["a"])
        decode.submit(lambda e: e.add_request("b", long_prompt[::-1], PARAMS, prefill_peer=good))
        decode.submit(lambda e: e.add_request("c", short_prompt, PARAMS))  # prefilled locally
        decode.wait(["b", "c"])
        a, b, c = (decode.first[r] for r in "abc")
        assert (a.prefilled_by, a.prefill_failures) == (good, [dead])
        assert (b.prefilled_by, b.prefill_failures) == (good, [])
        assert (c.prefilled_by, c.prefill_failures) == (None, [])
        rest = [len(decode.outputs[r]) for r in "abc"]
        assert rest == [PARAMS.max_tokens] * 3
        decode.wait_idle()
        prefill.wait_idle()


def test_every_prefill_worker_failing_is_reported_with_the_local_fallback():
    with silent_peer() as dead:
        decode = FirstOutputs(
            build_engine(
                pd_config(
                    "decode", prefill_endpoints=[dead], bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5
                )
            )
        )
        try:
            decode.submit(lambda e: e.add_request("a", prompts(3)[2], PARAMS))
            decode.wait(["a"])
            a = decode.first["a"]
            assert (a.prefilled_by, a.prefill_failures) == (None, [dead])
            assert decode.engine.stats()["kv_local_prefill_fallbacks_total"] == 1
            decode.wait_idle()
        finally:
            decode.stop()
