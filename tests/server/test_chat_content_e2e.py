"""Chat content parts this text-only model cannot read are refused, never dropped: a 400 whose
`param` names the part, from the router and from a worker's own OpenAI API alike, through the
official openai client. Text parts (as a list) still work."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
pytestmark = pytest.mark.slow

IMAGE = {
    "type": "image_url",
    "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAf"
        "FcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    },
}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
TEXT = {"type": "text", "text": "What is in this picture?"}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """The router's URL and its decode worker's (which serves the OpenAI API itself too)."""
    port = free_port()
    log = tmp_path_factory.mktemp("pd") / "pd.log"
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--prefill", "1", "--decode", "1", "--port", str(port)]
    with ServerProcess(cmd, port, log) as srv:
        srv.wait_ready(timeout=300)
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
        yield {"router": srv.url, "worker": next(w["url"] for w in workers if w["role"] == "decode")}


def _refused(client: openai.OpenAI, messages: list, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **kw)
    assert e.value.status_code == 400
    return e.value.body


@pytest.mark.parametrize("front", ["router", "worker"])
def test_parts_the_model_cannot_read_are_refused_naming_the_part(urls, front):
    client = openai.OpenAI(base_url=urls[front] + "/v1", api_key="unused", max_retries=0)
    err = _refused(client, [{"role": "user", "content": [TEXT, IMAGE]}])
    assert err["param"] == "messages[0].content[1]" and err["code"] == "unsupported_content", err
    assert err["type"] == "invalid_request_error" and "vision encoder" in err["message"], err
    err = _refused(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [AUDIO, TEXT]}],
        stream=True,
    )
    assert err["param"] == "messages[1].content[0]" and "audio encoder" in err["message"], err
    err = _refused(client, [{"role": "user", "content": [TEXT, {"type": "hologram"}]}])
    assert err["param"] == "messages[0].content[1]" and "unknown" in err["message"], err
    # Text parts as a list, an assistant's refusal part among them, still get an answer.
    ok = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {"role": "user", "content": [TEXT, {"type": "text", "text": " Answer in one word."}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot see pictures."}]},
            {"role": "user", "content": [{"type": "text", "text": "Then say hello."}]},
        ],
    )
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.prompt_tokens > 10
