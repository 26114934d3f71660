"""Tracing end to end: a PD deployment (router, prefill and decode processes) exports its spans over
OTLP/HTTP to a real receiver here; one streamed request is one trace across the router, the decode
worker (its prefill by a peer, the KV transfer, its decode) and the prefill worker (the job it ran),
the router's audit line names the trace, and an error body carries its trace id."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import yaml

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env

pytestmark = pytest.mark.slow
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from otlp_receiver import Receiver  # noqa: E402


def _audit_trace(log: str, path: str, status: int) -> str:
    found = re.findall(rf"POST {re.escape(path)} status={status} ms=\S+ trace=([0-9a-f]{{32}})", log)
    assert found, log[-3000:]
    return found[-1]


def test_one_trace_across_router_and_workers(tmp_path):
    rx = Receiver()
    try:
        cfg = tmp_path / "pd.yaml"
        cfg.write_text(yaml.safe_dump({"model": {"name": "tiny-qwen2"}, "server": {"otlp_endpoint": rx.url}}))
        port = free_port()
        cmd = pdserve_cmd() + ["serve", "--config", str(cfg), "--port", str(port)]
        with ServerProcess(cmd, port, tmp_path / "pd.log", env=thread_env(1)) as srv:
            srv.wait_ready(timeout=180)
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            prompt = [(37 * j) % 4000 + 10 for j in range(120)]  # long enough for the prefill worker
            chunks = list(
                client.completions.create(
                    model="tiny-qwen2",
                    prompt=prompt,
                    max_tokens=8,
                    stream=True,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            assert chunks
            r = httpx.post(
                srv.url + "/v1/completions", json={"model": "tiny-qwen2", "prompt": "hi", "max_tokens": 0}
            )
            assert r.status_code == 400
            bad_trace = r.json()["error"]["trace_id"]
            time.sleep(0.5)
            log = srv.log_tail(1_000_000)
            ok_trace = _audit_trace(log, "/v1/completions", 200)
            assert _audit_trace(log, "/v1/completions", 400) == bad_trace
            want = {
                ("pdserve-router", "POST /v1/completions"),
                ("pdserve-router", "router.queue"),
                ("pdserve-router", "router.route"),
                ("pdserve-router", "router.attempt"),
                ("pdserve-decode", "worker.generate"),
                ("pdserve-decode", "worker.prefill"),
                ("pdserve-decode", "worker.decode"),
                ("pdserve-decode", "kv.transfer"),
                ("pdserve-prefill", "prefill.job"),
            }
            deadline = time.monotonic() + 20
            while not want <= set(rx.of(ok_trace)):
                assert time.monotonic() < deadline, (sorted(set(rx.of(ok_trace))), len(rx.spans))
                time.sleep(0.2)
            # The decode worker names the prefill worker that filled the prompt: a peer, not itself.
            assert rx.attrs(ok_trace, "worker.prefill")["prefilled_by"].startswith("tcp://")
            while ("pdserve-router", "POST /v1/completions") not in rx.of(bad_trace):
                assert time.monotonic() < deadline, rx.of(bad_trace)
                time.sleep(0.2)
            assert ok_trace != bad_trace
    finally:
        rx.close()
