from __future__ import annotations

import socket

from pdserve.utils.net import advertise_host, with_host


def test_with_host_replaces_the_host_of_tcp_and_http_endpoints_only():
    assert with_host("tcp://0.0.0.0:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert with_host("http://0.0.0.0:8000", "pod-a.svc") == "http://pod-a.svc:8000"
    assert with_host("tcp://[::]:9000", "fd00::7") == "tcp://[fd00::7]:9000"
    assert with_host("ipc:///tmp/kv-events", "10.1.2.3") == "ipc:///tmp/kv-events"
    assert with_host("tcp://127.0.0.1:5557", None) == "tcp://127.0.0.1:5557"


def test_advertise_host_prefers_config_then_environment_then_the_bind_address(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADVERTISE_HOST", raising=False)
    assert advertise_host("127.0.0.1") == "127.0.0.1"
    assert advertise_host("10.0.0.5", "worker-3.internal") == "worker-3.internal"
    wildcard = advertise_host("0.0.0.0")
    assert wildcard not in ("0.0.0.0", "") and wildcard in (
        socket.gethostname(),
        socket.gethostbyname(socket.gethostname()),
    )
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.9.8.7")  # a pod's status.podIP
    assert advertise_host("0.0.0.0") == "10.9.8.7"
    assert advertise_host("0.0.0.0", "explicit") == "explicit"
