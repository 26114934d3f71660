"""Shared by the control-plane tests (role switch, controller): client threads streaming greedy
completions through the official openai client, admin calls, and waiting for a worker's pool to
return to its start. (pytest puts tests/ on the path.)"""

from __future__ import annotations

import threading
import time

import httpx
import openai

MODEL = "tiny-qwen2"
ADMIN = "admin-key-5d1e"
MAX_TOKENS = 48


def prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * j) % 30000 + 100 for j in range(80 + i % 5)]  # long enough for a remote prefill


PROMPTS = [prompt(i) for i in range(12)]


def offline_outputs(prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[str]:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in LLM(model=MODEL).generate(prompts, params)]


def admin(url: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300, **kw)


def workers(url: str) -> dict[str, dict]:
    return {w["id"]: w for w in admin(url, "GET", "/admin/workers").json()["workers"]}


def wait_for(cond, what, timeout: float = 60.0):
    """`cond()` once it is truthy; past the deadline an AssertionError saying `what` (a string, or a
    callable asked then, so the message can show the state that was waited on)."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)
    return got


def decoding(worker_url: str) -> int:
    """The streams the worker itself has in its running batch now (its /health), not the router's
    in-flight count, which also counts requests still waiting for their prefill elsewhere."""
    return httpx.get(worker_url + "/health", timeout=10).json()["running"]


class Load:
    """Client threads streaming greedy completions until stopped; records every text and error."""

    def __init__(
        self, url: str, threads: int = 4, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
    ) -> None:
        self.prompts, self.max_tokens = prompts, max_tokens
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
                stream = self.client.completions.create(
                    model=MODEL,
                    prompt=self.prompts[i % len(self.prompts)],
                    temperature=0,
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                self.done.append((i % len(self.prompts), "".join(c.choices[0].text for c in stream)))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
            i += len(self.threads)

    def progress(self, n: int, what: str, timeout: float = 120.0) -> None:
        """Wait until `n` more requests have finished."""
        start = len(self.done)
        wait_for(lambda: len(self.done) >= start + n, what, timeout)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def wrong(self, want: list[str]) -> list[tuple[int, str]]:
        return [(i, text) for i, text in self.done if text != want[i]]


def pool_at_start(worker_url: str) -> dict:
    """The worker's /health once nothing runs and every KV block is free (cached ones count as free)."""

    def idle():
        h = httpx.get(worker_url + "/health", timeout=10).json()
        ok = (
            h["running"] == 0
            and h["waiting"] == 0
            and h.get("loading", 0) == 0
            and h["kv_blocks_free"] == h["kv_blocks_total"]
            and not h.get("kv_blocks_quarantined")
            and not h.get("kv_prefill_jobs_active")
        )
        return h if ok else None

    return wait_for(idle, f"{worker_url}: pool not back to its start", timeout=60)


def counter_sum(metrics_text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith(name + "{"))
