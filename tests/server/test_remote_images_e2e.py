"""Remote image URLs through a real server and the official openai client: tiny-llava served with
`vision.allow_remote_urls` and `vision.remote_url_allow_networks: [127.0.0.2/32]` (that loopback
address plays a public image host). An image fetched from there answers as the same image sent
inline does; one on 127.0.0.1 (the server's own loopback), directly or through a redirect from the
allowed host, gets a 400 whose message says nothing of why. A bad network in the config exits 2
naming the key."""

from __future__ import annotations

import openai
import pytest
from image_server import MAX, PNG, image_server
from vlm_images import data_url

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config
from pdserve.config_rules import ConfigError

MODEL = "tiny-llava"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    (d / "c.yaml").write_text(
        f"model: {{name: {MODEL}}}\nvision: {{allow_remote_urls: true, max_image_bytes: {MAX}, "
        "remote_url_allow_networks: [127.0.0.2/32]}\n"
    )
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--mode", "mixed", "--config", str(d / "c.yaml"), "--port", str(port)]
    with ServerProcess(cmd, port, d / "log") as srv:
        srv.wait_ready(timeout=300)
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, url: str) -> str:
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    )
    return r.choices[0].message.content


def test_remote_images_from_an_allowed_network_only(client):
    with image_server("127.0.0.2") as (_, allowed), image_server("127.0.0.1") as (local, loopback):
        assert _ask(client, allowed + "/img.png") == _ask(client, data_url(PNG))
        assert _ask(client, f"{allowed}/redirect?/img.png") == _ask(client, data_url(PNG))
        for url in (
            loopback + "/img.png",
            f"{allowed}/redirect?{loopback}/img.png",
            allowed + "/missing.png",
        ):
            with pytest.raises(openai.BadRequestError) as e:
                _ask(client, url)
            err = e.value.body
            assert err["param"] == "messages[0].content[1]" and err["code"] == "invalid_image", err
            assert err["message"] == "messages[0].content[1]: could not fetch the image", err
        assert local.seen == []


def test_a_bad_allowed_network_names_the_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"vision.remote_url_allow_networks": ["10.0.0.0/33"]})
    assert any(k == "vision.remote_url_allow_networks" and "CIDR" in msg for k, msg in e.value.problems)
