"""Remote image URLs (`vision.allow_remote_urls`) reach public addresses only, over real sockets on
loopback: nothing here touches an outside network. Loopback servers stand in for an internal
service (refused) and, once a test allows their network explicitly, for a public image host (so the
real fetch path runs: redirects, the deadline, the size cap, the pinned address). Which addresses
are public is checked on names resolved by a resolver the test passes in."""

from __future__ import annotations

import http.server
import logging

import pytest
from image_server import MAX, PNG, image_server
from vlm_images import image_bytes

from pdserve.chat_content import chat_inputs
from pdserve.common.errors import APIError
from pdserve.common.images import ImageError, open_image
from pdserve.common.remote_images import FETCH_FAILED, checked_addresses, fetch_image, parse_networks
from pdserve.config import VisionConfig
from pdserve.protocol import ChatMessage

ALLOW = parse_networks(["127.0.0.2/32"])  # the "public" host of these tests


def _refused(url: str, **kw) -> None:
    with pytest.raises(ImageError) as e:
        fetch_image(url, **{"max_bytes": MAX, "timeout_s": 20.0, "allow_networks": ALLOW, **kw})
    assert str(e.value) == FETCH_FAILED


def _chat(url: str) -> list[ChatMessage]:
    return [
        ChatMessage.model_validate(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        )
    ]


def test_a_loopback_image_server_is_refused():
    """The server's own loopback services are not the client's to fetch, through the chat API either."""
    with image_server("127.0.0.1") as (srv, base):
        limits = VisionConfig(allow_remote_urls=True, remote_timeout_s=20.0)
        for url in (base + "/img.png", base.replace("127.0.0.1", "localhost") + "/img.png"):
            with pytest.raises(APIError) as e:
                chat_inputs(_chat(url), "m", "<image>", limits)
            assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
            assert e.value.message == f"messages[0].content[1]: {FETCH_FAILED}"
        assert srv.seen == []  # never even connected to


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "192.0.2.1",
        "198.18.0.1",
        "::1",
        "::",
        "fe80::1",
        "fe80::1%eth0",
        "fc00::1",
        "fd12:3456::1",
        "fec0::1",
        "ff02::1",
        "2001:db8::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "2002:7f00:1::1",
        "2002:a00:1::1",
        "64:ff9b::a00:1",
        "64:ff9b::7f00:1",
        "2001:0:4136:e378:8000:63bf:f5ff:fffe",
    ],
)
def test_non_public_addresses_are_refused(address, caplog):
    calls = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append((host, port))
        return [address]

    with caplog.at_level(logging.WARNING, logger="pdserve.common.remote_images"):
        _refused("http://images.example:8080/a.png", resolve=resolve, allow_networks=())
    assert calls == [("images.example", 8080)]
    assert "not a public address" in caplog.text  # the reason is in the log, not in the answer


@pytest.mark.parametrize(
    "addresses", [["93.184.216.34"], ["8.8.8.8", "1.1.1.1"], ["2606:4700:4700::1111"], ["::ffff:8.8.8.8"]]
)
def test_public_addresses_pass_the_check(addresses):
    assert checked_addresses("images.example", 443, lambda h, p: addresses, ()) == addresses


def test_one_private_address_among_public_ones_refuses_the_host():
    _refused("https://images.example/a.png", resolve=lambda h, p: ["8.8.8.8", "10.0.0.7"], allow_networks=())


def test_an_allowed_network_is_fetched_from_with_redirects_checked_at_each_hop():
    with image_server("127.0.0.2") as (a, base_a), image_server("127.0.0.1") as (b, base_b):
        assert fetch_image(base_a + "/img.png", MAX, 20.0, ALLOW) == PNG
        assert fetch_image(f"{base_a}/redirect?{base_a}/img.png", MAX, 20.0, ALLOW) == PNG
        assert fetch_image(f"{base_a}/redirect?/img.png", MAX, 20.0, ALLOW) == PNG  # relative Location
        _refused(f"{base_a}/redirect?{base_b}/img.png")  # an allowed host sends us to loopback
        assert b.seen == []
        for target in ("file:///etc/passwd", "ftp://127.0.0.2/x.png", "gopher://127.0.0.2:70/x"):
            _refused(f"{base_a}/redirect?{target}")
        n = len(a.seen)
        _refused(base_a + "/loop")
        assert len(a.seen) - n == 4  # the first request and 3 redirects, then it gives up


def test_one_answer_for_every_failure():
    with image_server("127.0.0.2") as (_, base):
        closed = http.server.ThreadingHTTPServer(("127.0.0.2", 0), http.server.BaseHTTPRequestHandler)
        port = closed.server_address[1]
        closed.server_close()  # nothing listens there now
        for url in (
            f"http://127.0.0.2:{port}/img.png",
            base + "/missing.png",
            base + "/big",
            base + "/big-chunked",
            "http://[::1]:1/img.png",
            "http://127.0.0.2:99999/img.png",
        ):
            _refused(url)


def test_the_deadline_bounds_the_whole_fetch():
    """Every read of the dripping server comes well within a second; the fetch as a whole may not take
    more than one: it fails instead of returning the image seconds later."""
    with image_server("127.0.0.2") as (_, base):
        assert fetch_image(base + "/img.png", MAX, 1.0, ALLOW) == PNG
        _refused(base + "/drip", timeout_s=1.0)


def test_the_address_checked_is_the_one_connected_to():
    """The name is resolved once: a resolver that answers an allowed address and then a refused one (DNS
    rebinding) gets the allowed one used, and the server sees the name in its Host header."""
    with image_server("127.0.0.2") as (a, base):
        port = a.server_address[1]
        answers = [["127.0.0.2"]]

        def resolve(host: str, _port: int) -> list[str]:
            return answers.pop(0) if answers else ["127.0.0.1"]

        assert fetch_image(f"http://images.example:{port}/img.png", MAX, 20.0, ALLOW, resolve=resolve) == PNG
        assert a.seen == [("/img.png", f"images.example:{port}")]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_pillow_opens_the_image_formats(fmt):
    assert open_image(image_bytes(5, fmt), 10_000).size == (40, 48)


@pytest.mark.parametrize("fmt", ["TIFF", "PPM", "ICO", "TGA", "PCX"])
def test_pillow_opens_no_other_format(fmt):
    with pytest.raises(ImageError, match="not a decodable image"):
        open_image(image_bytes(5, fmt), 10_000)


def test_eps_never_reaches_ghostscript(monkeypatch):
    from PIL import EpsImagePlugin

    calls = []

    def ghostscript(*args, **kwargs):
        calls.append(args)
        raise OSError("Ghostscript ran")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\nshowpage\n%%EOF\n"
    with pytest.raises(ImageError):
        open_image(eps, 10_000)
    assert calls == []
