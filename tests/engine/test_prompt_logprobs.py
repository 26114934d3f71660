"""Prompt logprobs (SamplingParams.prompt_logprobs; the API's echo with logprobs, and vLLM's
prompt_logprobs): one entry per prompt token, None for the first, each the model's own logprob of
that token given the ones before it. They equal a whole-sequence forward's on every path that
computes a prompt: chunked prefill, a prompt whose prefix is cached (a request that collects them
never takes a cache hit), and a PD prefill worker (which computes them with the prompt and sends
them beside the first token); the KV pools return to their start."""

from __future__ import annotations

from paged_logits import assert_logprobs_close
from pd_harness import MODEL, pd_pair

from pdserve import LLM, SamplingParams
from pdserve.bench.quality import sequence_logits

PROMPT = [(7 * j) % 250 + 1 for j in range(37)]


def _reference(model, ids: list[int]) -> list[float]:
    lp = sequence_logits(model, ids).double().log_softmax(-1)
    return [float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)]


def test_chunked_and_cached_prompts_give_the_whole_forwards_logprobs():
    llm = LLM(model=MODEL, device_blocks=256, max_num_batched_tokens=16, block_size=4)
    want = _reference(llm.engine.model, PROMPT)
    free = llm.engine.pool.num_free
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]  # caches the prefix
    for _ in range(2):
        out = llm.generate([PROMPT], params)[0]
        assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
        assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
        entries = out.prompt_logprobs[1:]
        assert [e.token_id for e in entries] == PROMPT[1:]
        assert_logprobs_close([e.logprob for e in entries], want)
        for e in entries:  # the two best, best first; the token's rank among all
            assert len(e.top) == 2 and e.top[0][1] >= e.top[1][1] and e.rank >= 1
            assert (e.rank == 1) == (e.top[0][0] == e.token_id)
    assert llm.engine.pool.num_free == free


def test_a_pd_prefill_worker_computes_them_with_the_prompt():
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    llm = LLM(model=MODEL)
    want = llm.generate([PROMPT], params)[0]
    with pd_pair() as (prefill, decode):
        got: dict[str, list] = {}
        orig = decode._record

        def record(out):
            if out is not None and out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
            orig(out)

        decode._record = record
        # Twice the same prompt: the second asks again, so neither worker takes a cache hit for it.
        decode.run([PROMPT, PROMPT], params)
        for rid in ("r0", "r1"):
            assert decode.outputs[rid] == want.token_ids
            assert got[rid][0] is None and [e.token_id for e in got[rid][1:]] == PROMPT[1:]
            assert [e.top[0][0] for e in got[rid][1:]] == [e.top[0][0] for e in want.prompt_logprobs[1:]]
            assert_logprobs_close(
                [e.logprob for e in got[rid][1:]], [e.logprob for e in want.prompt_logprobs[1:]]
            )
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 2 and s["kv_local_prefill_fallbacks_total"] == 0
        assert s["prefill_tokens_computed"] == 0  # the decode worker computed no prompt itself
        decode.wait_idle()
        prefill.wait_idle()
