"""Prompt logprobs through a real PD deployment (`pdserve serve`: router, prefill and decode worker
processes) and the official openai client, as an evaluation harness asks for them: echo with
logprobs and max_tokens 1 (the first prompt token's entry is None, then one per prompt token, then the
generated one), and vLLM's prompt_logprobs. They equal the offline engine's, the same on a second
call (whose prefix is cached), a stream asking for them gets a 400, and the pools return to their start."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from paged_logits import assert_logprobs_close

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
PROMPT = [(7 * j) % 250 + 1 for j in range(45)]
pytestmark = pytest.mark.slow


def test_echo_logprobs_and_prompt_logprobs_through_pd(tmp_path):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    want = LLM(model=MODEL).generate([PROMPT], params)[0]
    want_lps = [e.logprob for e in want.prompt_logprobs[1:]]
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--port", str(port)]
    with ServerProcess(cmd, port, tmp_path / "serve.log") as srv:
        srv.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # the second call's prefix is cached: the logprobs do not change
            r = client.completions.create(
                model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
            )
            lp = r.choices[0].logprobs
            assert len(lp.token_logprobs) == len(PROMPT) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert_logprobs_close(lp.token_logprobs[1 : len(PROMPT)], want_lps)
            assert_logprobs_close(lp.token_logprobs[-1:], [want.logprobs[0].logprob])
            assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
        r = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
        )
        plp = r.choices[0].model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(PROMPT)
        assert_logprobs_close([plp[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))], want_lps)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"prompt_logprobs": 0},
        )
        assert chat.model_extra["prompt_logprobs"][0] is None
        bad = httpx.post(
            srv.url + "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
        for w in httpx.get(srv.url + "/admin/workers").json()["workers"]:
            deadline = time.monotonic() + 30
            while (h := httpx.get(w["url"] + "/health").json())["kv_blocks_free"] != h["kv_blocks_total"]:
                assert time.monotonic() < deadline, f"{w['role']} pool not back to its start: {h}"
                time.sleep(0.2)
