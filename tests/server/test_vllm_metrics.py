"""vLLM's metric names on a live worker's /metrics: every metric the Gateway API Inference
Extension's model-server protocol reads, with its type and labels, and every metric vLLM's example
Grafana dashboard queries, with data after a few requests; and the vLLM families agree with
pdserve's own (they are fed by the same observations)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config
from pdserve.server.metrics import ServerMetrics
from pdserve.server.vllm_metrics import token_buckets

MODEL = "tiny-qwen2"
QUERIES = Path(__file__).parent / "assets" / "vllm_dashboard_queries.txt"
# The inference extension's endpoint picker: queue length, running batch, KV cache utilisation (under
# both names it has read), LoRA adapters.
PROTOCOL = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:lora_requests_info": "gauge",
}
# Prompts of different lengths, one sent twice (a prefix cache hit), with their max_tokens.
PROMPTS = [("Hello there, how are you today?", 5), ("A", 3), ("Hello there, how are you today?", 4)]
PROMPTS += [("one two three four five six seven eight nine ten eleven twelve thirteen", 6)]


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-metrics")
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--mode", "mixed", "--model", MODEL, "--port", str(port)]
    with ServerProcess(cmd, port, d / "log") as srv:
        srv.wait_ready(timeout=300)
        for prompt, max_tokens in PROMPTS:
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        yield httpx.get(srv.url + "/metrics", timeout=30).text


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples: dict, name: str, **labels) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


@pytest.mark.slow
def test_protocol_metrics_have_their_types_and_labels(metrics_text):
    fams = _families(metrics_text)
    for name, kind in PROTOCOL.items():
        assert name in fams, f"{name} missing from /metrics"
        assert fams[name].type == kind, (name, fams[name].type)
        (sample,) = fams[name].samples
        if name == "vllm:lora_requests_info":
            assert sample.labels == {
                "max_lora": "0",
                "running_lora_adapters": "",
                "waiting_lora_adapters": "",
            }
            assert sample.value > 0  # when it was updated: the picker takes the latest
        else:
            assert sample.labels == {"model_name": MODEL, "engine": "0"}
    # The worker is idle once the requests are answered, and usage is a fraction.
    assert fams["vllm:num_requests_running"].samples[0].value == 0
    assert 0 <= fams["vllm:kv_cache_usage_perc"].samples[0].value <= 1
    # Every vLLM family carries model_name (the dashboards' filter), and engine unless it is the LoRA info.
    for f in fams.values():
        if f.name.startswith("vllm:") and f.name != "vllm:lora_requests_info":
            for s in f.samples:
                assert s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0", s


@pytest.mark.slow
def test_every_dashboard_query_finds_its_series(metrics_text):
    samples = _samples(metrics_text)
    # The dashboard's model_name variable: label_values({__name__=~"vllm:.*"}, model_name).
    models = {
        s.labels["model_name"]
        for n, ss in samples.items()
        if n.startswith("vllm:")
        for s in ss
        if "model_name" in s.labels
    }
    assert models == {MODEL}
    queries = [q for q in QUERIES.read_text().splitlines() if q and not q.startswith("#")]
    names = {n for q in queries for n in re.findall(r"vllm:[A-Za-z0-9_:]+", q)}
    assert len(names) >= 15
    for name in sorted(names):
        got = [s for s in samples.get(name, []) if s.labels.get("model_name") == MODEL]
        assert got, f"the dashboard queries {name}; /metrics has no series of it for {MODEL}"
    # ... and the series carry the requests just served.
    n = len(PROMPTS)
    for hist in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
    ):
        assert _value(samples, f"vllm:{hist}_count", model_name=MODEL) == n, hist
    assert _value(samples, "vllm:request_max_num_generation_tokens_sum", model_name=MODEL) == sum(
        m for _, m in PROMPTS
    )
    done = {
        r: _value(samples, "vllm:request_success_total", model_name=MODEL, finished_reason=r)
        for r in ("stop", "length", "abort", "error")
    }
    assert done["stop"] + done["length"] == n and done["abort"] == done["error"] == 0, done


@pytest.mark.slow
def test_vllm_families_agree_with_pdserves(metrics_text):
    samples = _samples(metrics_text)
    v = lambda name: _value(samples, name, model_name=MODEL)  # noqa: E731
    p = lambda name: _value(samples, name)  # noqa: E731
    assert v("vllm:generation_tokens_total") == p("pdserve_generation_tokens_total") > 0
    assert v("vllm:prompt_tokens_total") == p("pdserve_prompt_tokens_total") > 0
    assert v("vllm:prefix_cache_queries_total") == p("pdserve_prefix_cache_queried_tokens_total") > 0
    assert v("vllm:prefix_cache_hits_total") == p("pdserve_prefix_cache_hit_tokens_total")
    assert v("vllm:num_preemptions_total") == p("pdserve_preemptions_total")
    # The same observations: same counts and sums (floats summed in the same order).
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds"):
        for part in ("_count", "_sum"):
            assert v(f"vllm:{hist}{part}") == p(f"pdserve_{hist}{part}"), hist + part
    assert v("vllm:time_per_output_token_seconds_count") == p("pdserve_inter_token_latency_seconds_count")
    assert v("vllm:request_time_per_output_token_seconds_count") == p(
        "pdserve_time_per_output_token_seconds_count"
    )
    # Queue + prefill + decode is the time from arrival to the last token, at most the e2e latency.
    parts = sum(v(f"vllm:request_{k}_time_seconds_sum") for k in ("queue", "prefill", "decode"))
    e2e = v("vllm:e2e_request_latency_seconds_sum")
    assert 0 < parts <= e2e * (1 + 1e-9)


def test_off_by_config_key():
    assert load_config().server.vllm_metrics is True
    cfg = load_config(overrides={"server.vllm_metrics": False})
    assert cfg.server.vllm_metrics is False
    stats = {"running": 2, "waiting": 1, "kv_usage": 0.25}
    off = ServerMetrics(lambda: stats).render().decode()
    on = ServerMetrics(lambda: stats, ("m", 512)).render().decode()
    assert "vllm:" not in off and "pdserve_num_requests_waiting" in off
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0' in on
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25' in on


def test_token_buckets_reach_the_context():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1) == [1]
