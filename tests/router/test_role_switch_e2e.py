"""Role switches under streaming load, real processes: a router, one prefill and two decode workers
(`pdserve serve`), four client threads streaming greedy completions through the official openai
client. While they run, workers switch role through `POST /admin/workers/{id}/role`: one with no
time to drain (its in-flight streams move to another decode worker mid-generation), one that drains.
No request fails, every output equals the offline engine's, `/admin/workers` shows the new roles,
and every worker's KV pool is back to its start."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
ADMIN = "admin-key-5d1e"
MAX_TOKENS = 48
pytestmark = pytest.mark.slow


def _prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * j) % 30000 + 100 for j in range(80 + i % 5)]    # long enough for a remote prefill


PROMPTS = [_prompt(i) for i in range(12)]


def _admin(url: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300, **kw)


def _workers(url: str) -> dict[str, dict]:
    return {w["id"]: w for w in _admin(url, "GET", "/admin/workers").json()["workers"]}


def _wait(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return got


class Load:
    """Client threads streaming greedy completions until stopped; records every text and error."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.done: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            try:
                stream = self.client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], temperature=0,
                                                        max_tokens=MAX_TOKENS, stream=True,
                                                        extra_body={"ignore_eos": True})
                self.done.append((i % len(PROMPTS), "".join(c.choices[0].text for c in stream)))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
            i += len(self.threads)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def _pool_at_start(worker_url: str) -> dict:
    def idle():
        h = httpx.get(worker_url + "/health", timeout=10).json()
        ok = (h["running"] == 0 and h["waiting"] == 0 and h.get("loading", 0) == 0
              and h["kv_blocks_free"] == h["kv_blocks_total"] and not h.get("kv_blocks_quarantined")
              and not h.get("kv_prefill_jobs_active"))
        return h if ok else None
    return _wait(idle, f"{worker_url}: pool not back to its start", timeout=60)


def test_role_switches_under_streaming_load(tmp_path):
    want = [o.text for o in LLM(model=MODEL).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))]
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(yaml.safe_dump({"router": {"admin_keys": [ADMIN], "health_period_s": 0.2}}))
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--prefill", "1", "--decode", "2", "--port", str(port),
                           "--config", str(cfg)]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        ws = _workers(url)
        [p1] = [i for i, w in ws.items() if w["role"] == "prefill"]
        d1, d2 = sorted(i for i, w in ws.items() if w["role"] == "decode")
        urls = {i: w["url"] for i, w in ws.items()}

        # The admin API: a key, a known role, a known worker.
        assert httpx.post(url + f"/admin/workers/{d1}/role", json={"role": "prefill"}).status_code == 401
        r = _admin(url, "POST", f"/admin/workers/{d1}/role", json={"role": "encoder"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert _admin(url, "POST", "/admin/workers/nobody/role", json={"role": "decode"}).status_code == 404

        load = Load(url)
        try:
            # 1. d1 -> prefill with no time to drain: its streams in flight move to d2 mid-generation.
            _wait(lambda: _workers(url)[d1]["load"]["in_flight"] > 0, "no stream reached d1")
            r = _admin(url, "POST", f"/admin/workers/{d1}/role", json={"role": "prefill", "drain_timeout_s": 0})
            assert r.status_code == 200, r.text
            assert r.json()["role"] == "prefill"
            # d2 is the last decode worker now: it may not switch away.
            r = _admin(url, "POST", f"/admin/workers/{d2}/role", json={"role": "prefill"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "last_decode"
            n = len(load.done)
            _wait(lambda: len(load.done) >= n + 4, "no progress with one decode worker", timeout=120)
            # 2. p1 -> decode, drained (its prefill jobs finish), then d2 -> prefill: the pools swap.
            r = _admin(url, "POST", f"/admin/workers/{p1}/role", json={"role": "decode"})
            assert r.status_code == 200 and r.json()["role"] == "decode", r.text
            r = _admin(url, "POST", f"/admin/workers/{d2}/role", json={"role": "prefill", "drain_timeout_s": 0})
            assert r.status_code == 200 and r.json()["role"] == "prefill", r.text
            n = len(load.done)
            _wait(lambda: len(load.done) >= n + 4, "no progress after the swap", timeout=120)
            # 3. d1 back to decode.
            r = _admin(url, "POST", f"/admin/workers/{d1}/role", json={"role": "decode"})
            assert r.status_code == 200 and r.json()["role"] == "decode", r.text
            n = len(load.done)
            _wait(lambda: len(load.done) >= n + 4, "no progress after switching back", timeout=120)
        finally:
            load.finish()

        assert load.errors == []
        assert len(load.done) >= 12
        wrong = [(i, text) for i, text in load.done if text != want[i]]
        assert wrong == [], f"{len(wrong)} of {len(load.done)} outputs differ from the offline engine's"
        roles = {i: w["role"] for i, w in _workers(url).items()}
        assert roles == {p1: "decode", d1: "decode", d2: "prefill"}
        for i, u in urls.items():
            h = _pool_at_start(u)
            assert h["role"] == roles[i]
        metrics = httpx.get(url + "/metrics").text
        moved = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("pdserve_router_worker_moved_total{"))
        assert moved >= 1, "no stream was moved off a switching worker"
        # The switched workers took work in their new roles.
        after = _workers(url)
        assert after[d2]["requests"] > ws[d2]["requests"] and after[p1]["requests"] > ws[p1]["requests"]
