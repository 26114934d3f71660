"""Images through a real deployment and the official openai client: tiny-llava served PD (router,
a prefill worker whose images go to its encoder worker process, a decode worker), asked through
the router and through the decode worker's own OpenAI API (the mixed path: it prefills locally).
The greedy answer equals the offline engine's, a repeated image is a prefix-cache hit, and bad
images get a 400 naming the part."""

from __future__ import annotations

import httpx
import openai
import pytest
from vlm_images import data_url, image_bytes, image_chat

from pdserve import SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.engine.llm import LLM

MODEL = "tiny-llava"
pytestmark = pytest.mark.slow
CONFIG = "model: {name: tiny-llava}\nvision: {encoder_processes: 1, max_images: 2}\n"


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    (d / "c.yaml").write_text(CONFIG)
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--config",
        str(d / "c.yaml"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--port",
        str(port),
    ]
    with ServerProcess(cmd, port, d / "log") as srv:
        srv.wait_ready(timeout=300)
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
        yield {
            "router": srv.url,
            "worker": next(w["url"] for w in workers if w["role"] == "decode"),
            "all": [w["url"] for w in workers],
        }


@pytest.fixture(params=["router", "worker"])
def server(request, urls):
    return urls[request.param], urls["all"]


@pytest.fixture(scope="module")
def offline():
    return LLM(model=MODEL)


def _hit_tokens(workers: list[str]) -> int:
    return sum(httpx.get(w + "/health", timeout=10).json()["prefix_cache_hit_tokens"] for w in workers)


def test_image_chat_equals_offline_and_repeats_hit_the_cache(server, offline):
    url, workers = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    want = offline.chat(image_chat(11), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]

    def ask():
        r = client.chat.completions.create(
            model=MODEL,
            messages=image_chat(11),
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].message.content, r.usage.prompt_tokens

    text, n_prompt = ask()
    assert (text, n_prompt) == (want.text, len(want.prompt_token_ids))
    before = _hit_tokens(workers)
    assert ask()[0] == want.text
    assert _hit_tokens(workers) - before >= n_prompt - 16  # every full block, the image's included
    stream = client.chat.completions.create(
        model=MODEL,
        messages=image_chat(11),
        max_tokens=8,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def _refused(client, content) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert e.value.status_code == 400
    return e.value.body


def test_bad_images_are_refused_naming_the_part(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    text = {"type": "text", "text": "Look:"}
    img = {"type": "image_url", "image_url": {"url": data_url(image_bytes(1))}}
    err = _refused(
        client, [text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    )
    assert err["param"] == "messages[0].content[1]" and err["code"] == "invalid_image", err
    assert "not a decodable image" in err["message"]
    err = _refused(client, [text, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert err["param"] == "messages[0].content[1]" and "vision.allow_remote_urls" in err["message"], err
    err = _refused(client, [img, img, text, img])
    assert err["param"] == "messages[0].content[3]" and err["code"] == "too_many_images", err
    err = _refused(client, [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}])
    assert "unsupported media type" in err["message"], err
    err = _refused(client, [{"type": "text", "text": "<empty_output>"}, img])
    assert "image token" in err["message"], err
