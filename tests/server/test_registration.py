from __future__ import annotations

import socket

from pdserve.server import registration


def test_router_targets_fan_out_over_every_address_of_a_name(monkeypatch):
    def fake_getaddrinfo(host, port, type=0):  # a headless Service over three router pods
        table = {
            "routers.svc": ["10.0.0.7", "10.0.0.8", "10.0.0.7", "fd00::9"],
            "127.0.0.1": ["127.0.0.1"],
            "v6only": ["fd00::1"],
        }
        if host not in table:
            raise socket.gaierror("unknown")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in table[host]
        ]

    monkeypatch.setattr(registration.socket, "getaddrinfo", fake_getaddrinfo)
    got = registration.router_targets(
        "http://routers.svc:8000/, https://router.example:443,"
        "http://127.0.0.1:9000,http://nowhere:1,http://v6only:8000"
    )
    assert got == [
        "http://10.0.0.7:8000",
        "http://10.0.0.8:8000",
        "https://router.example:443",
        "http://127.0.0.1:9000",
        "http://[fd00::1]:8000",
    ]
