"""`pdserve bench` against a real `pdserve serve --mode mixed` process on loopback.

The server runs a tiny random-weight model so a run takes seconds. Checks: the JSON adds up
(completed + failed = N), token counts agree with the server's own answers (usage seen through
the official openai client, and /metrics counters when the server exports them), and a server
killed mid-run becomes counted errors, not an exception.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.bench.cli import main as bench_main
from pdserve.bench.client import ClientConfig, run_load
from pdserve.bench.metrics import summarize
from pdserve.bench.procs import ServerProcess, ServerStartError, free_port, pdserve_cmd, thread_env
from pdserve.bench.workloads import make_workload

pytestmark = pytest.mark.slow

MODEL = os.environ.get("PDSERVE_BENCH_TEST_MODEL", "tiny-llama")


class Server(ServerProcess):
    """`pdserve serve --mode mixed` on a free port, one compute thread (the machine has two
    cores and the load client needs the other)."""

    def __init__(self, tmp: Path, cmd: list[str] | None = None):
        port = free_port()
        cmd = cmd or pdserve_cmd() + ["serve", "--mode", "mixed", "--model", MODEL, "--port", str(port)]
        super().__init__(cmd, port, tmp / f"server-{port}.log", env=thread_env(1))

    def wait_ready(self, timeout: float = 240.0) -> None:
        # Every start-up failure fails the run: an import regression ("No module named") is a bug
        # in this checkout, never a reason to skip.
        try:
            super().wait_ready(timeout)
        except ServerStartError as e:
            pytest.fail(f"`pdserve serve` did not start: {e}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("srv"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_a_server_that_cannot_import_fails_instead_of_skipping(tmp_path):
    """An import regression in the server ("No module named ...") is a failure, never a skip."""
    srv = Server(tmp_path, cmd=[sys.executable, "-c", "import pdserve_no_such_module"])
    try:
        with pytest.raises(pytest.fail.Exception, match="No module named 'pdserve_no_such_module'"):
            srv.wait_ready(timeout=120)
    except pytest.skip.Exception as e:
        pytest.fail(f"a server that cannot import its modules was turned into a skip: {e}")
    finally:
        srv.stop()


def scrape_counter(text: str, pattern: str) -> float | None:
    """Sum of samples of the first Prometheus counter whose name matches pattern, or None."""
    total, name = 0.0, None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)", line)
        # One counter only: a worker also exports vLLM's names for the same counts (vllm:*).
        if (
            m
            and re.search(pattern, m.group(1))
            and m.group(1).endswith("_total")
            and name in (None, m.group(1))
        ):
            total += float(m.group(3))
            name = m.group(1)
    return total if name is not None else None


def token_counters(url: str) -> tuple[float | None, float | None]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (
        scrape_counter(text, r"prompt_tokens"),
        scrape_counter(text, r"(generation|completion|output)_tokens"),
    )


def test_bench_json_consistent_with_server(server, tmp_path):
    before = token_counters(server.url)
    out = tmp_path / "r.json"
    n = 12
    rc = bench_main(
        [
            "--base-url",
            server.url,
            "--workload",
            "chat",
            "-n",
            str(n),
            "-c",
            "4",
            "--max-tokens",
            "12",
            "--seed",
            "1",
            "--output-json",
            str(out),
            "--save-requests",
            "--no-progress",
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0, r["errors"]
    assert r["completed"] + r["failed"] == n
    assert r["failed"] == 0, r["errors"]
    assert r["usage_missing"] == 0  # the server sent usage on every stream
    reqs = r["requests"]
    assert sum(q["completion_tokens"] for q in reqs) == r["output_tokens"]
    assert sum(q["prompt_tokens"] for q in reqs) == r["input_tokens"]
    for q in reqs:
        assert 1 <= q["completion_tokens"] <= 12
        assert len(q["chunk_times"]) <= q["completion_tokens"]
        if q["finish_reason"] == "length":
            assert q["completion_tokens"] == 12
    assert r["ttft_ms"]["count"] == n
    assert r["output_throughput_tok_s"] > 0 and r["duration_s"] > 0
    assert r["e2e_ms"]["p99"] >= r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"] > 0
    # The server's own token counters moved by exactly what the client counted.
    after = token_counters(server.url)
    assert None not in before + after, "the server exports no prompt/generation token counters"
    assert after[1] - before[1] == r["output_tokens"]
    assert after[0] - before[0] == r["input_tokens"]


def test_streamed_text_and_usage_match_openai_client(server):
    """The same greedy requests through the official openai client, not streamed: the text the
    bench reassembled from SSE chunks and its token counts equal the server's plain answers."""
    cfg = ClientConfig(base_url=server.url)
    sessions = make_workload("chat", 3, seed=5, max_tokens=10)
    # One at a time, as the plain calls below are: a batch of random-weight logits could flip a
    # near-tie between the two ways of computing the same greedy step.
    records, _ = asyncio.run(run_load(cfg, sessions, concurrency=1))
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = oc.models.list().data[0].id
    for s, rec in zip(sessions, records):
        assert rec.ok, rec.error_detail
        resp = oc.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": s.turns[0].text}],
            max_tokens=10,
            temperature=0.0,
        )
        assert resp.usage.completion_tokens == rec.completion_tokens
        assert resp.usage.prompt_tokens == rec.prompt_tokens
        assert resp.choices[0].message.content == rec.text


def test_completions_api_and_multiturn(server):
    cfg = ClientConfig(base_url=server.url, api="completions")
    recs, _ = asyncio.run(run_load(cfg, make_workload("fixed", 4, input_len=20, max_tokens=6), concurrency=2))
    assert all(r.ok for r in recs), [r.error_detail for r in recs]
    assert all(1 <= r.completion_tokens <= 6 for r in recs)
    # Conversations: later turns carry the history, so their prompts are longer.
    ss = make_workload("multiturn", 6, seed=2, max_tokens=5)
    recs, dur = asyncio.run(run_load(ClientConfig(base_url=server.url), ss, concurrency=2))
    assert all(r.ok for r in recs), [r.error_detail for r in recs]
    first = {r.id.split(".")[0]: r.prompt_tokens for r in recs if r.id.endswith(".0")}
    for r in recs:
        if not r.id.endswith(".0"):
            assert r.prompt_tokens > first[r.id.split(".")[0]]
    assert summarize(recs, dur)["completed"] == 6


def test_sweep_writes_json_and_plot(server, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    hits = httpx.get(server.url + "/health").json()["prefix_cache_hit_tokens"]
    rc = bench_main(
        [
            "--base-url",
            server.url,
            "--api",
            "completions",  # no chat template: prompts that differ share no block
            "--seed",
            "4242",  # words no other test of this server sent (fixed's words follow the seed)
            "--workload",
            "fixed",
            "--input-len",
            "48",
            "-n",
            "4",
            "--max-tokens",
            "8",
            "--sweep-concurrency",
            "1,4",
            "--output-json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert [p["concurrency"] for p in r["sweep"]] == [1, 4]
    assert all(p["completed"] + p["failed"] == 4 for p in r["sweep"])
    # Each level drew its own prompts: the second found none of the first's in the prefix cache.
    assert httpx.get(server.url + "/health").json()["prefix_cache_hit_tokens"] == hits
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_server_killed_mid_run_counts_errors(tmp_path):
    """SIGKILL the server after a few replies: the run finishes, every request is accounted
    for, and the failures are counted by kind."""
    srv = Server(tmp_path)
    try:
        srv.wait_ready()
        n, done = 40, []

        def on_done(rec):
            done.append(rec)
            if len(done) == 3:
                srv.kill()

        sessions = make_workload("chat", n, seed=9, max_tokens=24)
        recs, dur = asyncio.run(
            run_load(
                ClientConfig(base_url=srv.url, request_timeout_s=60), sessions, concurrency=4, on_done=on_done
            )
        )
        s = summarize(recs, dur)
        assert s["completed"] + s["failed"] == n == len(done)
        assert s["completed"] >= 3 and s["failed"] >= n - 3 - 4
        # Streams cut in flight and requests refused after the death, nothing else.
        assert set(s["errors"]) <= {"connection_dropped", "connect_error", "stream_truncated"}
        assert s["errors"].get("connect_error", 0) >= 1
    finally:
        srv.stop()


def test_poisson_rate_and_rejected_requests_counted(server, tmp_path):
    """Open-loop arrivals from a JSONL workload in which one prompt exceeds the tiny model's
    2048-token context: the server refuses it with a 4xx, counted under its status."""
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        json.dumps({"prompt": "hello " * 3000, "max_tokens": 4, "tag": "huge"})
        + "\n"
        + json.dumps({"prompt": "Say something.", "max_tokens": 4, "tag": "small"})
        + "\n"
    )
    out = tmp_path / "r.json"
    bench_main(
        [
            "--base-url",
            server.url,
            "--workload",
            str(wl),
            "-n",
            "6",
            "-r",
            "20",
            "--output-json",
            str(out),
            "--no-progress",
        ]
    )
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["failed"] == 3
    assert len(r["errors"]) == 1
    ((kind, count),) = r["errors"].items()
    assert kind.startswith("http_4") and count == 3
    assert r["by_tag"]["huge"]["failed"] == 3 and r["by_tag"]["small"]["completed"] == 3
