"""The OpenAI API of a real mixed-mode server process on loopback, through the official client."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with ServerProcess(
        pdserve_cmd()
        + ["serve", "--mode", "mixed", "--model", MODEL, "--port", str(port), "--max-model-len", "2048"],
        port,
        log,
    ) as srv:
        srv.wait_ready(timeout=180)
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def _wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(server)
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]:
            return h
        assert time.monotonic() < deadline, f"server did not return to idle: {h}"
        time.sleep(0.2)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _health(server)["status"] == "ok"


def test_log_names_the_resolved_quantization(server):
    # The default, auto, is logged as what it resolved to: the packaged file stores Q4_1.
    assert "quantization int4" in server.log_path.read_text(errors="replace")


def test_chat_matches_offline_engine(client, smollm_files):
    # Both as installed: quantization auto, the file's Q4_1 served as int4 (the offline engine packs the
    # same values from its float copy).
    llm = LLM(model=MODEL, loaded=smollm_files)
    assert llm.config.model.quantization == "int4"
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    offline = llm.chat([MESSAGES], SamplingParams(temperature=0, max_tokens=24))[0]
    assert resp.choices[0].message.content == offline.text
    assert "Paris" in offline.text
    assert resp.choices[0].finish_reason == offline.finish_reason
    assert resp.usage.completion_tokens == len(offline.token_ids)
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_chat_stream_with_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_text_tokens_and_stream(client, server):
    a = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert a.usage.completion_tokens == 8 and a.choices[0].finish_reason == "length"
    ids = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": [504, 3575, 282], "max_tokens": 3, "temperature": 0},
    ).json()
    assert ids["usage"]["prompt_tokens"] == 3
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == a.choices[0].text


def test_stop_strings_seed_and_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16, seed=1234)
    assert (
        client.chat.completions.create(**kw).choices[0].message.content
        == client.chat.completions.create(**kw).choices[0].message.content
    )
    lp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy picks the top token


BAD = [
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"model": "no-such-model", "messages": MESSAGES}, "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ({"model": MODEL, "messages": "not a list"}, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL}, "messages"),
]


@pytest.mark.parametrize(
    "body,param", BAD, ids=[p for _, p in BAD][:3] + ["too-long", "type", "type2", "missing"]
)
def test_bad_input_is_400_with_openai_error(client, server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    if "messages" in body:  # the client itself refuses a body without messages
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**body)


def test_invalid_json_and_long_prompt(server, client):
    r = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="word " * 2100, max_tokens=4)
    # The server still serves after every bad request.
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = _wait_idle(server)
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        # Keep the line iterator alive: abandoning it makes httpcore close the connection at once.
        stream = r.iter_lines()
        chunks = 0
        while chunks < 3:
            chunks += next(stream).startswith("data: ")
        assert _health(server)["running"] == 1
    after = _wait_idle(server)
    assert after["kv_blocks_free"] == before["kv_blocks_free"]


def test_disconnect_non_streaming_aborts(server):
    _wait_idle(server)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    _wait_idle(server)


def _busy(srv, mode: str) -> bool:
    h = _health(srv)
    if mode == "mixed":
        return h["running"] > 0
    return any(w["load"]["in_flight"] for w in h["workers"] if w["role"] == "decode")


@pytest.mark.parametrize("mode", ["mixed", "pd"])
def test_sigterm_finishes_running_requests_and_exits_0(tmp_path, mode):
    port = free_port()
    srv = ServerProcess(
        pdserve_cmd() + ["serve", "--mode", mode, "--model", "tiny-llama", "--port", str(port)],
        port,
        tmp_path / "server.log",
    )
    srv.wait_ready(timeout=120)
    result: dict = {}

    def run() -> None:
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 300, "ignore_eos": True}
        result["resp"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not _busy(srv, mode):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.proc.wait(60) == 0, srv.log_tail()
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.text)["usage"]["completion_tokens"] == 300
