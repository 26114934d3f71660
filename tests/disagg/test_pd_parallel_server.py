"""Long prompts prefilled by two prefill worker processes in a pipeline, through the router.

`pdserve serve` with two prefill workers and one decode worker on the real default model: the router
offers the decode worker both prefill workers for a prompt above disagg.parallel_prefill_min_tokens,
the decode worker cuts it between them, and the greedy replies equal the offline engine's.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pdserve import SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a library. Patrons ask about opening hours, borrowing rules, "
    "late fees, study rooms, printing, the children's section and events. Answer in one short "
    "sentence, plainly, without preamble, and never repeat the question back to the patron. "
) * 3
QUESTIONS = [
    "When does the library open on Sundays?",
    "Can I renew a book online?",
    "Is there a fee for printing?",
]


def test_long_prompts_pipelined_over_two_prefill_workers_equal_the_offline_engine(tmp_path, smollm_llm):
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=16)
    want = [o.text for o in smollm_llm.chat(conversations, params)]
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "disagg": {"parallel_prefill_min_tokens": 100, "transfer_timeout_s": 60},
                "deployment": {"prefill": {"max_num_batched_tokens": 1024}},
            }
        )
    )
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--prefill",
        "2",
        "--decode",
        "1",
        "--quantization",  # float32 like smollm_llm, the offline engine it is compared with
        "none",
        "--config",
        str(config),
        "--no-prefix-cache",
    ]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=300)
        deadline = time.monotonic() + 120  # both prefill workers healthy at the router, with their endpoints
        while (
            sum(
                1
                for w in httpx.get(srv.url + "/health").json()["workers"]
                if w["role"] == "prefill" and w.get("healthy")
            )
            < 2
        ):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = [
            client.chat.completions.create(model=MODEL, messages=c, temperature=0, max_tokens=16)
            .choices[0]
            .message.content
            for c in conversations
        ]
        decode = next(w for w in httpx.get(srv.url + "/health").json()["workers"] if w["role"] == "decode")[
            "url"
        ]
        h = httpx.get(decode + "/health").json()
    assert got == want
    assert h["kv_parallel_prefills_total"] == len(QUESTIONS) and h["kv_parallel_prefills_failed_total"] == 0
    assert h["kv_transfers_completed_total"] == len(QUESTIONS)
