"""A whole PD deployment (router + prefill + decode processes) on the real default model.

Greedy outputs through the router equal the offline engine's for every transport; the decode
worker's pool returns to its start; prompts shorter than the threshold are prefilled locally.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from deploy_assets import exported_metrics, referenced_metrics

from pdserve import SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "List two planets bigger than Earth.",
]
SYSTEM = (
    "You are a concise assistant. Answer in one short sentence, without preamble, and never "
    "repeat the question back to the user."
)
CONVERSATIONS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
SHORT = "The capital of France is"  # fewer tokens than the threshold: prefilled by the decode worker


def _deployment(tmp_path, backend: str) -> ServerProcess:
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--transfer-backend",
        backend,
        "--local-prefill-max-tokens",
        "32",
        "--no-prefix-cache",
        "--quantization",  # float32 like smollm_llm, the offline engine it is compared with
        "none",
    ]
    return ServerProcess(cmd, port, tmp_path / f"pd-{backend}.log")


def _worker(router_url: str, role: str) -> dict:
    return next(w for w in httpx.get(router_url + "/health").json()["workers"] if w["role"] == role)


def _wait_pool_idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health").json()
        if h["running"] == 0 and h["loading"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]:
            return h
        assert time.monotonic() < deadline, f"pool did not return to its start: {h}"
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_server_equals_offline_engine(tmp_path, smollm_llm, backend):
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.text for o in smollm_llm.chat(CONVERSATIONS, params)] + [
        smollm_llm.generate(SHORT, params)[0].text
    ]
    with _deployment(tmp_path, backend) as srv:
        srv.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = [
            client.chat.completions.create(model=MODEL, messages=c, temperature=0, max_tokens=24)
            .choices[0]
            .message.content
            for c in CONVERSATIONS
        ]
        got.append(
            client.completions.create(model=MODEL, prompt=SHORT, temperature=0, max_tokens=24).choices[0].text
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=CONVERSATIONS[0], temperature=0, max_tokens=24, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        decode = _worker(srv.url, "decode")["url"]
        h = _wait_pool_idle(decode)
        prefill_url = _worker(srv.url, "prefill")["url"]
        prefill = httpx.get(prefill_url + "/health").json()
        # Every series deploy/'s alert rules and dashboard query is served by this deployment.
        served = set().union(
            *(exported_metrics(httpx.get(u + "/metrics").text) for u in (srv.url, decode, prefill_url))
        )
    assert referenced_metrics() <= served, sorted(referenced_metrics() - served)
    assert got == want
    assert streamed == want[0]
    assert h["kv_transfers_completed_total"] == len(CONVERSATIONS) + 1  # + the stream; SHORT stayed local
    assert h["kv_transfers_failed_total"] == 0
    assert prefill["kv_send_bytes_total"] > 0 and prefill["kv_prefill_jobs_active"] == 0
