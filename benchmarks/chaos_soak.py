"""A chaos soak: a whole PD deployment under twice its capacity while faults drawn from a seed overlap.

The deployment (tests/cluster/pd_cluster.py, each process on its own network-namespace host): two
router replicas with their rate limits shared through Redis, the controller on in both (the one
holding the lease in Redis acts; controller.backend: hosts), two prefill and two decode workers (tiny-qwen2, random weights: fast,
and its greedy output depends on the KV), the Redis host as their shared KV tier, and each
worker's disk tier on one small tmpfs. Each worker host runs a host agent (`pdserve agent`) that
starts its workers: the soak's first ones, and those the controller adds or a rollout starts.
Workers are counted by process: a host may run none (the controller removed its worker) or two
(a rollout's new one beside the old one).

Phases, all in one run:
1. reference: every request of the mixed pool (multi-turn chat over a shared system prompt, long
   prompts, short ones, streamed and not, structured outputs through response_format, sampled
   ones) once, fault-free: the text each greedy request must give again;
2. capacity: a closed loop at a few concurrencies; capacity is the best goodput (requests done
   right with their time to first token within the SLO, per second);
3. baseline: an open (Poisson) load at twice the capacity, no faults: the goodput faults are
   measured against;
4. chaos: the same load for --duration seconds while the fault schedule runs (each fault in its own
   thread, so they overlap; one fault per target at a time): kill -9 and restart of a worker, a
   host's link down, SIGSTOP/SIGCONT, a slow link (tbf token bucket; netem is not needed), router-b
   partitioned from a worker, a role switch and back, Redis killed and restarted, the disk tier full,
   hostile clients (oversized, malformed, NaN sampling values, slow readers, disconnects), a
   hostile peer on every worker's KV socket, a rollout (`pdserve rollout` of the other of two
   versions, canary first) and a rollback (a rollout whose SLO check fails: its new worker is
   replaced by the old version again); a rollout that stops and rolls back because another fault
   took its new worker is an outcome, not a violation;
5. drain: load stopped, faults lifted, every worker healthy and idle.

Violations (each printed with the seed, the exit status is 1 when there is any): a request that got
neither its reference text nor a clear refusal (a 4xx with an OpenAI-style body, a 429/503 with
Retry-After, or for a stream already answered 200 an error event of type service_unavailable,
counted apart as "refused mid-stream"), a transport error, a request past its deadline; a hostile
request answered other than with a 4xx; KV blocks still held after the drain; a process whose file
descriptors or threads grew past its post-warm-up count (plus a small slack for pooled connections
and lazily started threads) or whose resident memory grew more than --rss-tolerance over its
post-warm-up value (warm-up: the baseline and the chaos phase's first third; for a process
restarted later, the first third of its life, at least 30 s); a rollout that exits other than done
(0) or rolled back (1). Printed: the schedule, each phase's figures, goodput with each fault kind
active / baseline goodput, and a chart (PNG; CSV beside it) of every process's memory.

Needs redis-server. Hosts are network namespaces where the machine allows them (root, iproute2),
else loopback addresses (`--hosts loopback`): every fault of a process, of Redis and of the
requests still runs there; a link down, a slow link and a partition are left out, and without root
so is the full disk (it needs a tmpfs mount), each printed with why.

Usage: python benchmarks/chaos_soak.py [--duration 1800] [--seed 1] [--out DIR] [--hosts auto|netns|loopback]
       [--kinds kill9,sigstop,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the namespace hosts live with the cluster tests

from cluster.cluster_hosts import (  # noqa: E402
    Cluster,
    LoopbackCluster,
    ShapingUnavailable,
    unavailable,
    wait_until,
)
from cluster.pd_cluster import (  # noqa: E402
    ADMIN,
    EVENTS_PORT,
    KV_PORT,
    MODEL,
    PORT,
    ROLES,
    TOKEN,
    PDCluster,
    prompt,
)

from pdserve.bench.json_schemas import schemas  # noqa: E402
from pdserve.bench.procs import pdserve_cmd, thread_env  # noqa: E402
from pdserve.protocol import INTERNAL_TOKEN_HEADER  # noqa: E402
from pdserve.router.shared_limits import POOL_CONNECTIONS as REDIS_POOL  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

API_KEY = "sk-chaos-soak"
DEADLINE_S = 120.0  # a request still unanswered after this long has hung
SLO_TTFT_S = 2.0  # the controller's default time-to-first-token SLO (goodput counts requests within it)
CLIENT_CAP = 96  # requests in flight from this process at most; an arrival beyond is counted, not sent
FD_SLACK, THREAD_SLACK = 16, 8  # pooled connections to restarted peers, lazily started executor threads
SAMPLE_S = 2.0
AGENT_PORT = 7070
# A stream already answered 200 can only end with an error event; these types say "retry later" as a
# 503 would (no worker could continue it), and count as clear refusals, printed apart.
CLEAR_STREAM_ERRORS = ("service_unavailable",)
OVERRIDES = {
    "router": {
        "api_keys": [API_KEY],
        "requests_per_minute": 1_000_000,  # never reached: the buckets live in Redis, which faults
        "shared_limits": True,
        # Overload is shed, not queued without bound: a bounded queue with a deadline, then 503.
        "max_concurrent": 4,
        "max_queue": 8,
        "queue_timeout_s": 2,
        "request_timeout_s": 60,
    },
    "controller": {
        "enabled": True,
        "interval_s": 2,
        "cooldown_s": 20,
        "drain_timeout_s": 5,
        # The deployment's four workers: one the controller adds replaces one that is down (killed,
        # stopped, cut off), and it removes one again once the pools are cold.
        "min_workers": 4,
        "max_workers": 4,
    },
}
FAULT_KINDS = [
    "kill9",
    "link_down",
    "sigstop",
    "slow_link",
    "router_partition",
    "role_switch",
    "redis_restart",
    "disk_full",
    "hostile_clients",
    "hostile_peer",
    "rollout",
    "rollback",
]
OMITTED: dict[str, str] = {}
FLEET_KINDS = ("rollout", "rollback")  # the whole fleet's: one at a time, beside every other fault


# ---------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Spec:
    key: str
    kind: str
    path: str
    body: dict
    stream: bool
    greedy: bool = True


def request_pool(seed: int) -> list[Spec]:
    """The mixed workload: each spec is sent many times; greedy ones must give their reference text."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "You are a careful assistant. " * 12}  # the shared prefix
    out: list[Spec] = []
    for i in range(8):  # multi-turn chat: later turns extend earlier ones
        turns = [system]
        for t in range(1 + i % 3):
            turns += [{"role": "user", "content": f"Question {i}.{t}: tell me about item {i * 7 + t}."}]
            if t < i % 3:
                turns += [{"role": "assistant", "content": f"Item {i * 7 + t} is fine."}]
        stream = bool(i % 2)
        body = {"model": MODEL, "messages": turns, "max_tokens": 16, "temperature": 0, "stream": stream}
        out.append(Spec(f"chat{i}", "chat", "/v1/chat/completions", body, stream))
    for i in range(4):  # long prompts
        body = {"model": MODEL, "prompt": prompt(1000 + i, 320), "max_tokens": 8, "temperature": 0}
        body |= {"ignore_eos": True, "stream": bool(i % 2)}
        out.append(Spec(f"long{i}", "long", "/v1/completions", body, bool(i % 2)))
    for i in range(8):  # short completions, mostly streamed
        body = {"model": MODEL, "prompt": prompt(2000 + i, 48), "max_tokens": 24, "temperature": 0}
        body |= {"ignore_eos": True, "stream": i % 4 != 0}
        out.append(Spec(f"short{i}", "short", "/v1/completions", body, i % 4 != 0))
    for i, schema in enumerate(schemas(4, seed=seed)):
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
        msgs = [{"role": "user", "content": f"Describe record {i} as JSON."}]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 64, "temperature": 0, "response_format": fmt}
        body |= {"stream": bool(i % 2)}
        out.append(Spec(f"json{i}", "structured", "/v1/chat/completions", body, bool(i % 2)))
    for i in range(2):  # sampled: no reference text, only a clean answer
        body = {"model": MODEL, "prompt": prompt(3000 + i, 32), "max_tokens": 16, "temperature": 0.8}
        body |= {"seed": rng.randrange(1 << 30), "stream": True}
        out.append(Spec(f"sampled{i}", "sampled", "/v1/completions", body, True, greedy=False))
    return out


@dataclass
class Result:
    spec: str
    kind: str
    router: str
    start: float
    status: int | None = None
    text: str = ""
    ttft: float | None = None
    seconds: float = 0.0
    outcome: str = ""  # ok | refused | refused mid-stream | violation
    why: str = ""
    stream_error: str = ""  # a clear error event that ended a stream already answered 200


def _headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def _text_of(kind: str, choice: dict) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def send(url: str, spec: Spec, router: str) -> Result:
    """One request; classified against nothing yet (see classify)."""
    r = Result(spec.key, spec.kind, router, time.monotonic())
    try:
        with httpx.Client(timeout=httpx.Timeout(DEADLINE_S, connect=10), headers=_headers()) as c:
            if not spec.stream:
                resp = c.post(url + spec.path, json=spec.body)
                r.status, r.ttft = resp.status_code, time.monotonic() - r.start
                if resp.status_code == 200:
                    r.text = _text_of(spec.kind, resp.json()["choices"][0])
                else:
                    r.why = _refusal(resp.status_code, resp.headers, resp.text)
            else:
                with c.stream("POST", url + spec.path, json=spec.body) as resp:
                    r.status = resp.status_code
                    if resp.status_code != 200:
                        resp.read()
                        r.why = _refusal(resp.status_code, resp.headers, resp.text)
                    else:
                        parts = []
                        for line in resp.iter_lines():
                            if time.monotonic() - r.start > DEADLINE_S:
                                r.why = f"hang: still streaming after {DEADLINE_S:.0f}s"
                                break
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                err = ev["error"]
                                if err.get("type") in CLEAR_STREAM_ERRORS and err.get("message"):
                                    r.stream_error = f"{err.get('code')}: {err['message']}"
                                else:
                                    r.why = f"stream ended in an unclear error event: {err}"
                                break
                            if r.ttft is None:
                                r.ttft = time.monotonic() - r.start
                            if ev.get("choices"):
                                parts.append(_text_of(spec.kind, ev["choices"][0]))
                        r.text = "".join(parts)
    except httpx.TimeoutException as e:
        r.why = f"hang: no answer within {DEADLINE_S:.0f}s ({type(e).__name__})"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        r.why = f"transport error: {type(e).__name__}: {e}"
    r.seconds = time.monotonic() - r.start
    return r


def send_until_admitted(url: str, spec: Spec, deadline_s: float = 300) -> Result:
    """`send`, again after each 429/503 (waiting its Retry-After) until admitted or `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = send(url, spec, "router")
        if r.status not in (429, 503) or r.why or time.monotonic() > deadline:
            return r
        time.sleep(2.0)


def _refusal(status: int, headers, body: str) -> str:
    """'' for a clear refusal (4xx with an OpenAI-style error body; 429/503 with Retry-After too),
    else what is wrong with it."""
    try:
        clear = isinstance(json.loads(body).get("error", {}).get("message"), str)
    except (ValueError, AttributeError):
        clear = False
    if status in (429, 503):
        return "" if "retry-after" in headers else f"{status} without Retry-After"
    if 400 <= status < 500:
        return "" if clear else f"{status} without an OpenAI-style error body: {body[:200]!r}"
    return f"{status}: {body[:200]!r}"


def classify(r: Result, spec: Spec, refs: dict[str, str]) -> None:
    if r.status == 200 and not r.why and r.stream_error:
        r.outcome = "refused mid-stream"
    elif r.status == 200 and not r.why:
        if r.seconds > DEADLINE_S:
            r.outcome, r.why = "violation", f"answered after its deadline ({r.seconds:.0f}s)"
        elif spec.greedy and spec.key in refs and r.text != refs[spec.key]:
            r.outcome, r.why = "violation", f"text differs from the reference: {r.text[:80]!r}"
        else:
            r.outcome = "ok"
    elif r.status is not None and r.status != 200 and not r.why:
        r.outcome = "refused"
    else:
        r.outcome = "violation"


# ---------------------------------------------------------------------------------------------- deployment


class _Pid:
    """What the soak reads of a process it did not start itself (a host agent's worker)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return -1
        return None if stat[stat.rindex(")") + 2] not in "ZX" else -1


class AgentWorker:
    """A worker its host's agent started (the agent is its parent: it reaps and restarts it)."""

    def __init__(self, c: SoakCluster, name: str, hw: dict) -> None:
        self.c, self.name, self.id = c, name, hw["id"]
        self.proc = _Pid(hw["pid"])
        self.healthy = bool(hw.get("healthy"))  # as its agent last listed it
        # Until the worker has bound its port the agent lists no URL: the host's fixed port for now,
        # the listing's once it is known (SoakCluster.refresh_all).
        self.url = (hw.get("url") or c.host(name).url(PORT)).rstrip("/")
        self.log_path = c.workdir / f"agent-{name}" / f"{self.id}.log"

    def kill(self) -> None:
        """SIGKILL the worker and its children at once: a crash, not a drain."""
        for pid in _tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_ready(self, timeout: float = 300.0) -> None:
        def ready() -> bool:
            hw = self.c.agent_worker(self.name, self.id)
            if hw is not None and not hw["alive"]:
                raise RuntimeError(
                    f"{self.id} on {self.name} exited with {hw['exit_code']}: {hw['log_tail']}"
                )
            if hw is not None and hw.get("url"):
                self.url = hw["url"].rstrip("/")
            return bool(hw and hw["healthy"])

        wait_until(ready, timeout, f"{self.id} on {self.name} healthy")


class SoakCluster(PDCluster):
    """PDCluster whose workers a host agent on each worker host starts (`pdserve agent`), as the
    routers' fleet (controller.backend: hosts) does for a rollout; each worker's disk tier on one
    tmpfs; no throttled transfer."""

    def __init__(self, workdir: Path, disk_mb: int, loopback: bool = False) -> None:
        self.disk = workdir / "disk"
        self.disk.mkdir(parents=True, exist_ok=True)
        # The disk tier on a filesystem of its own, small enough to fill (a tmpfs: root); without
        # one, a plain directory, and no disk_full fault.
        self.own_disk = os.geteuid() == 0
        if self.own_disk:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m", "pdsoak", str(self.disk)], check=True
            )
        try:
            super().__init__(workdir, overrides=OVERRIDES, loopback=loopback)
            self.refresh_all()  # from here on each worker is known by its host and its agent's id
        except BaseException:
            if self.own_disk:
                subprocess.run(["umount", "-l", str(self.disk)], check=False)
            raise

    def _start(self, redis: bool) -> None:
        agents = [self.host(n).url(AGENT_PORT) for n in ROLES]
        controller = {**self.overrides.get("controller", {}), "backend": "hosts", "agents": agents}
        self.overrides = {**self.overrides, "controller": controller}
        super()._start(redis)

    def worker_config(self, name: str, starts: int, transfer: dict | None) -> Path:
        import yaml

        # One config for every worker (and the routers): a rollout's version is a config's; the
        # disk tier's directory is each agent's (--disk-cache-dir), one per worker.
        path = self.workdir / "soak-workers.yaml"
        cache = {**self.cfg["cache"], "disk_cache_gb": 0.004, "host_cache_gb": 0.002}
        path.write_text(yaml.safe_dump({**self.cfg, "cache": cache}))
        return path

    def agent_call(self, name: str, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(
            method,
            self.host(name).url(AGENT_PORT) + path,
            headers={INTERNAL_TOKEN_HEADER: TOKEN},
            timeout=kw.pop("timeout", 60),
            **kw,
        )

    def agent_workers(self, name: str) -> list[dict]:
        return self.agent_call(name, "GET", "/agent/workers").json()["workers"]

    def agent_worker(self, name: str, worker_id: str) -> dict | None:
        return next((w for w in self.agent_workers(name) if w["id"] == worker_id), None)

    def _agent(self, name: str) -> None:
        key = f"agent-{name}"
        if key in self.procs:
            return
        h = self.host(name)
        routers = f"{self.host('router').url(PORT)},{self.host('router-b').url(PORT)}"
        cmd = pdserve_cmd() + ["agent", "--config", str(self.config_path), "--host", h.ip]
        cmd += ["--port", str(AGENT_PORT), "--router-url", routers, "--threads", "1"]
        cmd += ["--log-dir", str(self.workdir / key), "--disk-cache-dir", str(self.disk / name)]
        self.procs[key] = self.net.start(h, key, cmd, AGENT_PORT, env=thread_env(1))
        self.procs[key].wait_ready(timeout=120)

    def start_worker(self, name: str, transfer: dict | None = None) -> AgentWorker:  # type: ignore[override]
        """The host's first worker, through its agent, on the deployment's fixed ports."""
        import yaml

        self._agent(name)
        config = yaml.safe_load(self.worker_config(name, 0, transfer).read_text())
        body = {"role": ROLES[name], "config": config, "port": PORT, "kv_port": KV_PORT}
        r = self.agent_call(name, "POST", "/agent/workers", json={**body, "kv_events_port": EVENTS_PORT})
        r.raise_for_status()
        w = self.procs[name] = AgentWorker(self, name, r.json())
        return w

    def restart_worker(self, name: str, w: AgentWorker) -> AgentWorker | None:
        """`w` (exited) again, as a supervisor restarts a crashed process: its agent starts it with
        the same role, config, ports and disk tier."""
        wait_until(lambda: w.proc.poll() is not None, 30, f"{w.id} gone")
        r = self.agent_call(name, "POST", f"/agent/workers/{w.id}/restart")
        if r.status_code == 404:  # the fleet retired it while it was down: not to be restarted
            return None
        r.raise_for_status()
        new = self.procs[f"{name}/{r.json()['id']}"] = AgentWorker(self, name, r.json())
        return new

    def version_files(self) -> tuple[Path, Path]:
        """The deployment's config (A) and a second version (B) that changes a setting greedy
        outputs do not depend on: the two versions rollouts move the fleet between."""
        import yaml

        a = self.worker_config("", 0, None)
        b = self.workdir / "soak-workers-b.yaml"
        data = yaml.safe_load(a.read_text())
        b.write_text(yaml.safe_dump({**data, "scheduler": {**data.get("scheduler", {}), "max_num_seqs": 48}}))
        return a, b

    def other_version(self) -> Path:
        """The version file most workers do not run now."""
        from pdserve.config import load_config
        from pdserve.version import config_digest, version_label

        a, b = self.version_files()
        va, vb = (version_label(config_digest(load_config(p))) for p in (a, b))
        now = [w.get("version") for w in self.workers().values()]
        return b if now.count(va) >= now.count(vb) else a

    # Once up, workers are named "<host>/<agent's id>" in `procs`: a host may run none (the
    # controller removed it), or two (a rollout's replacement beside the old one; one the
    # controller added). Each process's memory, fds and threads are its own row.

    def live(self) -> dict[str, AgentWorker]:
        return {n: w for n, w in self.procs.items() if isinstance(w, AgentWorker)}

    def refresh_all(self) -> None:
        """`procs` as the agents list them: live workers added, exited ones dropped (their samples stay)."""
        for host in ROLES:
            try:
                listed = self.agent_workers(host)
            except (httpx.HTTPError, ValueError):
                continue  # its link is down: as it was
            alive = {f"{host}/{w['id']}": w for w in listed if w["alive"]}
            for label in [n for n in self.procs if n == host or n.startswith(host + "/")]:
                if label not in alive:
                    del self.procs[label]
            for label, w in alive.items():
                if label not in self.procs:
                    self.procs[label] = AgentWorker(self, host, w)
                    continue
                known = self.procs[label]
                assert isinstance(known, AgentWorker)
                known.healthy = bool(w.get("healthy"))
                if w.get("url"):  # bound since it was first listed
                    known.url = w["url"].rstrip("/")

    def current(self, host: str) -> AgentWorker | None:
        """The host's newest serving worker (a rollout's replacement once it runs; one still
        loading only when none serves), None if none runs."""
        self.refresh_all()
        mine = [w for n, w in self.live().items() if n.startswith(host + "/")]
        return max(mine, key=lambda w: (w.healthy, int(w.id.rsplit("-", 1)[1])), default=None)

    def wait_live_healthy(self, urls: list[str] | None = None, timeout: float = 60) -> None:
        """The given worker URLs (default: every live worker's) healthy at both routers."""

        def ok() -> bool:
            want = set(urls) if urls is not None else {w.url for w in self.live().values()}
            for r in ("router", "router-b"):
                got = httpx.get(
                    self.procs[r].url + "/admin/workers",
                    timeout=5,
                    headers={"Authorization": f"Bearer {ADMIN}"},
                ).json()["workers"]
                healthy = {w["url"].rstrip("/") for w in got if w.get("healthy")}
                if not want <= healthy:
                    return False
            return True

        wait_until(ok, timeout, "live workers healthy at both routers")

    def close(self) -> None:
        super().close()
        if self.own_disk:
            subprocess.run(["umount", "-l", str(self.disk)], check=False)


def _admin(c: PDCluster, method: str, path: str, router: str = "router", **kw) -> httpx.Response:
    return httpx.request(
        method,
        c.procs[router].url + path,
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=kw.pop("timeout", 30),
        **kw,
    )


def _last_decisions(c: SoakCluster, n: int = 3) -> list[str]:
    """Each router's last controller decisions and the fleet they read: why the fleet is its size."""
    out = []
    for r in ("router", "router-b"):
        try:
            ds = _admin(c, "GET", "/admin/controller", router=r).json()[-n:]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            out.append(f"{r}: GET /admin/controller failed: {e}")
            continue
        for d in ds:
            i = d.get("inputs", {})
            fleet = (
                f"{i.get('n_prefill', '?')}P+{i.get('n_decode', '?')}D, pressures "
                f"{i.get('prefill_pressure', '?')}/{i.get('decode_pressure', '?')}"
            )
            out.append(f"{r}'s controller: {d['action']} ({fleet}): {d['reason']}")
    return out


def held_blocks(c: SoakCluster, violations: list[str], timeout: float = 120) -> int:
    """KV blocks neither free nor cached on the live workers once idle (waits up to `timeout`)."""
    last: dict[str, object] = {}
    live = c.live()

    def idle() -> bool:
        for n, w in live.items():
            try:
                h = last[n] = httpx.get(w.url + "/health", timeout=5).json()
            except (httpx.HTTPError, ValueError) as e:
                last[n] = repr(e)
                return False
            busy = h.get("running") or h.get("waiting") or h.get("loading") or h.get("kv_prefill_jobs_active")
            if busy or h.get("kv_blocks_quarantined") or h.get("kv_blocks_free") != h.get("kv_blocks_total"):
                return False
        return True

    deadline = time.monotonic() + timeout
    while not idle():
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    held = 0
    for n, h in last.items():
        if not isinstance(h, dict) or "kv_blocks_total" not in h:
            violations.append(f"after the drain {n} reports no KV pool: {str(h)[:300]}")
        elif h["kv_blocks_free"] != h["kv_blocks_total"] or h.get("running") or h.get("waiting"):
            held += h["kv_blocks_total"] - h["kv_blocks_free"]
            keys = (
                "kv_blocks_free",
                "kv_blocks_total",
                "running",
                "waiting",
                "loading",
                "kv_prefill_jobs_active",
            )
            print(f"{n} not idle after the drain: " + ", ".join(f"{k}={h.get(k)}" for k in keys))
    return held


# ---------------------------------------------------------------------------------------------- memory


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(x) for x in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def proc_stats(pid: int, children: bool = True) -> tuple[int, int, int] | None:
    """(RSS bytes, open fds, threads) of a process and (unless told not to) its children; None once
    it is gone. A host agent's children are its workers, each counted on its own."""
    rss = fds = threads = 0
    try:
        for p in _tree(pid) if children else [pid]:
            status = Path(f"/proc/{p}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("State", "").strip().startswith("Z"):
                return None if p == pid else (rss, fds, threads)
            rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            threads += int(fields["Threads"])
            fds += len(os.listdir(f"/proc/{p}/fd"))
    except (OSError, KeyError, ValueError):
        return None if rss == 0 else (rss, fds, threads)
    return rss, fds, threads


class Sampler(threading.Thread):
    def __init__(self, c: SoakCluster, t0: float) -> None:
        super().__init__(daemon=True)
        self.c, self.t0 = c, t0
        self.rows: list[tuple[float, str, int, int, int, int]] = []  # t, name, pid, rss, fds, threads
        self.stop = threading.Event()

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        self.c.refresh_all()  # a rollout's, a restart's or the controller's new process; gone ones
        for name, srv in list(self.c.procs.items()):
            st = proc_stats(srv.proc.pid, not name.startswith("agent-"))
            if st is not None:
                self.rows.append((now, name, srv.proc.pid, *st))

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def last(self, name: str, pid: int, before: float) -> tuple[int, int, int] | None:
        rows = [r for r in self.rows if r[1] == name and r[2] == pid and r[0] <= before]
        return rows[-1][3:] if rows else None


def tcp_tally(c: PDCluster, name: str, pid: int) -> str:
    """The process's TCP sockets counted by (state, peer address), most first: what an fd growth is."""
    r = c.net.run(c.host(name.split("/")[0].removeprefix("agent-")), ["ss", "-tanpH"])
    counts: dict[str, int] = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if f"pid={pid}," in line and len(parts) >= 5:
            key = f"{parts[0]} {parts[4].rsplit(':', 1)[0]}:{parts[4].rsplit(':', 1)[1] if parts[0] == 'LISTEN' else '*'}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6]) or "none"


def chart(rows, out: Path, marks: dict[str, float]) -> str:
    csv_path = out / "chaos_soak_memory.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "process", "pid", "rss_bytes", "fds", "threads"])
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"{csv_path} (matplotlib is not installed: no PNG)"
    fig, ax = plt.subplots(figsize=(10, 5))
    for name in sorted({r[1] for r in rows}):
        pts = [(r[0], r[3] / 2**20) for r in rows if r[1] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1)
    for label, t in marks.items():
        ax.axvline(t, color="grey", ls=":", lw=1)
        ax.text(t, ax.get_ylim()[1], label, fontsize=7, rotation=90, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB, with children)")
    ax.set_title("chaos soak: resident memory per process")
    ax.legend(fontsize=7, loc="upper left")
    png = out / "chaos_soak_memory.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return f"{png} (data: {csv_path})"


# ---------------------------------------------------------------------------------------------- load


class Load:
    """Open-loop Poisson arrivals (or a closed loop) of the pool's requests over both routers."""

    def __init__(self, c: PDCluster, pool: list[Spec], refs: dict[str, str], seed: int) -> None:
        self.c, self.pool, self.refs = c, pool, refs
        self.rng = random.Random(seed)
        self.results: list[Result] = []
        self.capped = 0
        self.lock = threading.Lock()
        self.exe = concurrent.futures.ThreadPoolExecutor(CLIENT_CAP)
        self.inflight = 0

    def _one(self, spec: Spec, router: str) -> Result:
        try:
            r = send(self.c.procs[router].url, spec, router)
            classify(r, spec, self.refs)
            with self.lock:
                self.results.append(r)
            return r
        finally:
            with self.lock:
                self.inflight -= 1

    def submit(self) -> None:
        spec = self.rng.choice(self.pool)
        router = self.rng.choice(("router", "router-b"))
        with self.lock:
            if self.inflight >= CLIENT_CAP:
                self.capped += 1
                return
            self.inflight += 1
        self.exe.submit(self._one, spec, router)

    def open_loop(self, rate: float, seconds: float, stop: threading.Event | None = None) -> None:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while time.monotonic() < end and not (stop and stop.is_set()):
            nxt += self.rng.expovariate(rate)
            time.sleep(max(0.0, nxt - time.monotonic()))
            self.submit()

    def closed_loop(self, concurrency: int, seconds: float) -> list[Result]:
        end = time.monotonic() + seconds
        rng = random.Random(self.rng.random())

        def worker() -> list[Result]:
            got = []
            while time.monotonic() < end:
                with self.lock:
                    self.inflight += 1
                got.append(self._one(rng.choice(self.pool), rng.choice(("router", "router-b"))))
            return got

        with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
            return [r for f in [ex.submit(worker) for _ in range(concurrency)] for r in f.result()]

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.inflight == 0:
                    return True
            time.sleep(0.5)
        return False


def goodput(results: list[Result], seconds: float, slo: bool = True) -> float:
    """Right answers per second; with `slo`, only those whose first token came within the SLO."""
    good = [
        r for r in results if r.outcome == "ok" and (not slo or (r.ttft is not None and r.ttft <= SLO_TTFT_S))
    ]
    return len(good) / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------- faults


@dataclass
class Fault:
    at: float  # seconds into the chaos phase
    kind: str
    target: str
    hold: float  # how long the fault lasts
    began: float | None = None
    ended: float | None = None
    note: str = ""

    def line(self) -> str:
        return f"t={self.at:7.1f}s {self.kind:<16} {self.target:<10} for {self.hold:4.1f}s {self.note}"


def schedule(seed: int, duration: float, kinds: list[str]) -> list[Fault]:
    """Every kind at least once, then more drawn at random: about one fault start per 12 s. The
    whole fleet's kinds take the first slots, the rollback before the rollout: they take minutes
    and one at a time, and a rollout is judged on the requests its window sees, so they start
    while the load has the most of its time to run."""
    rng = random.Random(seed)
    workers = list(ROLES)
    n = max(len(kinds), int(duration / 12))
    picks = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(n - len(kinds))]
    fleet = [k for k in ("rollback", "rollout") if k in picks]
    for k in fleet:
        picks.remove(k)  # its first draw; a later one stays where it fell
    picks = fleet + picks
    out = []
    span = duration * 0.85  # the last faults end before the chaos phase does
    for i, kind in enumerate(picks):
        at = span * (i + rng.random() * 0.8) / len(picks)
        hold = rng.uniform(3, 12)
        target = {"redis_restart": "redis", "router_partition": rng.choice(workers)}.get(
            kind, rng.choice(workers)
        )
        if kind in ("hostile_clients", "hostile_peer"):
            target = "routers" if kind == "hostile_clients" else rng.choice(workers)
        if kind in FLEET_KINDS:
            target = "fleet"
        out.append(Fault(at, kind, target, hold))
    return sorted(out, key=lambda f: f.at)


class Spawner(threading.Thread):
    """Starts the processes a fault restarts. Every process is started with PR_SET_PDEATHSIG, which
    fires when the *thread* that forked it exits: a worker started from a fault's own thread got
    SIGTERM as soon as that fault ended. This thread lives as long as the run."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.jobs: queue.Queue = queue.Queue()

    def run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the fault that asked
                fut.set_exception(e)

    def call(self, fn, timeout: float = 60):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((fn, fut))
        return fut.result(timeout)


class Chaos:
    def __init__(self, c: SoakCluster, violations: list[str], seed: int) -> None:
        self.spawner = Spawner()
        self.spawner.start()
        self.c, self.violations = c, violations
        self.rng = random.Random(seed + 1)
        self.locks: dict[str, threading.Lock] = {
            n: threading.Lock() for n in [*ROLES, "redis", "routers", "fleet"]
        }
        self.hostile_results: list[str] = []

    def run(self, f: Fault, t0: float) -> None:
        time.sleep(max(0.0, t0 + f.at - time.monotonic()))
        lock = self.locks[f.target]
        # A rollout takes minutes: the next one waits for it longer than a fault waits for its target.
        wait = 600 if f.target == "fleet" else 60
        if not lock.acquire(timeout=wait):
            f.note = f"skipped: its target was busy with another fault for {wait} s"
            return
        try:
            f.began = time.monotonic() - t0
            getattr(self, f.kind)(f)
        except Exception as e:  # a fault that could not be made is a finding, not a crash of the soak
            self.violations.append(
                f"fault {f.kind} on {f.target} at {f.at:.1f}s failed: {type(e).__name__}: {e}"
            )
        finally:
            f.ended = time.monotonic() - t0
            lock.release()

    # -- each fault restores what it broke before it returns

    def kill9(self, f: Fault) -> None:
        srv = self.c.current(f.target)
        if srv is None:
            f.note = "skipped: no worker runs on the host"
            return
        srv.kill()
        time.sleep(f.hold)
        new = self.c.restart_worker(f.target, srv)
        if new is None:
            f.note = f"{srv.id} was retired by the fleet while down: not restarted"
            return
        new.wait_ready(timeout=300)
        self.c.wait_live_healthy([new.url], timeout=120)

    def link_down(self, f: Fault) -> None:
        h = self.c.host(f.target)
        self.c.net.link(h, up=False)
        try:
            time.sleep(f.hold)
        finally:
            self.c.net.link(h, up=True)

    def sigstop(self, f: Fault) -> None:
        srv = self.c.current(f.target)
        if srv is None:
            f.note = "skipped: no worker runs on the host"
            return
        Cluster.pause(srv, True)
        try:
            time.sleep(f.hold)
        finally:
            Cluster.pause(srv, False)

    def slow_link(self, f: Fault) -> None:
        h = self.c.host(f.target)
        self.c.net.shape(h, 2_000_000)
        try:
            time.sleep(f.hold)
        finally:
            self.c.net.shape(h, None)

    def router_partition(self, f: Fault) -> None:
        a, b = self.c.host("router-b"), self.c.host(f.target)
        self.c.net.cut(a, b)
        try:
            time.sleep(f.hold)
        finally:
            self.c.net.cut(a, b, cut=False)

    def role_switch(self, f: Fault) -> None:
        w = self.c.workers().get(f.target)
        if w is None or not w.get("healthy"):
            f.note = "skipped: the worker is not healthy at the router"
            return
        role = w["role"]
        other = "decode" if role == "prefill" else "prefill"
        r = _admin(self.c, "POST", f"/admin/workers/{w['id']}/role", json={"role": other}, timeout=120)
        f.note = f"{role}->{other}: {r.status_code}"
        if r.status_code != 200:
            if r.status_code >= 500:
                self.violations.append(f"role switch of {f.target} answered {r.status_code}: {r.text[:200]}")
            return
        time.sleep(f.hold)
        wid = self.c.workers()[f.target]["id"]
        back = _admin(self.c, "POST", f"/admin/workers/{wid}/role", json={"role": role}, timeout=120)
        f.note += f", back {back.status_code}"
        # Refused (the controller may have moved another worker meanwhile: "the last decode worker"
        # is a clear 409 and the worker keeps serving): retried for 120 s. Only a 5xx is a violation.
        deadline = time.monotonic() + 120
        while back.status_code != 200 and time.monotonic() < deadline:
            time.sleep(2)
            back = _admin(self.c, "POST", f"/admin/workers/{wid}/role", json={"role": role}, timeout=120)
        if back.status_code != 200:
            f.note += f"; still {other} after 120 s: {back.status_code} {back.text[:160]}"
            if back.status_code >= 500:
                self.violations.append(f"role switch of {f.target} back to {role}: {back.text[:200]}")

    def redis_restart(self, f: Fault) -> None:
        self.c.procs["redis"].kill()
        time.sleep(f.hold)
        self.spawner.call(self.c.start_redis)
        wait_until(
            lambda: (
                self.c.net.run(
                    self.c.host("redis"), ["redis-cli", "-h", self.c.host("redis").ip, "ping"]
                ).stdout.strip()
                == "PONG"
            ),
            30,
            "redis back",
        )

    def disk_full(self, f: Fault) -> None:
        filler = self.c.disk / f"filler-{f.at:.0f}"
        with filler.open("wb") as out:
            try:
                while True:
                    out.write(b"\0" * (1 << 20))
                    out.flush()
            except OSError:
                pass  # ENOSPC: the tier is full
        try:
            time.sleep(f.hold)
        finally:
            filler.unlink(missing_ok=True)

    def hostile_clients(self, f: Fault) -> None:
        end = time.monotonic() + f.hold
        urls = [self.c.procs[n].url for n in ("router", "router-b")]
        while time.monotonic() < end:
            url = self.rng.choice(urls)
            what = self.rng.choice(["oversized", "malformed", "nan", "slow_reader", "disconnect"])
            try:
                self._hostile(url, what)
            except httpx.HTTPError as e:
                self.violations.append(f"hostile {what} to {url}: {type(e).__name__}: {e}")

    def _hostile(self, url: str, what: str) -> None:
        h = {**_headers(), "Content-Type": "application/json"}
        with httpx.Client(timeout=30, headers=h) as c:
            if what in ("oversized", "malformed", "nan"):
                body = {
                    "oversized": json.dumps({"model": MODEL, "prompt": [5] * 200_000, "max_tokens": 4}),
                    "malformed": '{"model": "' + MODEL + '", "prompt": [1, 2,',
                    "nan": '{"model": "' + MODEL + '", "prompt": [1, 2, 3], "temperature": NaN}',
                }[what]
                r = c.post(url + "/v1/completions", content=body)
                self.hostile_results.append(f"{what}:{r.status_code}")
                if not 400 <= r.status_code < 500 or _refusal(r.status_code, r.headers, r.text):
                    self.violations.append(f"hostile {what} answered {r.status_code}: {r.text[:200]}")
                return
            body = {"model": MODEL, "prompt": prompt(self.rng.randrange(10**6), 40), "max_tokens": 48}
            body |= {"stream": True, "ignore_eos": True}
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                self.hostile_results.append(f"{what}:{r.status_code}")
                lines = r.iter_lines()
                for i, _ in enumerate(lines):
                    if what == "disconnect" or i >= 4:
                        break  # closing the response drops the connection mid-stream
                    time.sleep(1.0)  # a slow reader

    def hostile_peer(self, f: Fault) -> None:
        """Garbage, unsigned, wrongly signed and oversized frames at the worker's KV socket, and its
        internal HTTP API called without the token: each must be dropped or refused."""
        import zmq

        from pdserve.protocol import PD_DONE, pack

        h, srv = self.c.host(f.target), self.c.current(f.target)
        if srv is None:
            f.note = "skipped: no worker runs on the host"
            return
        if not srv.healthy:  # still loading (no port bound yet) or being stopped: nothing listens
            f.note = f"skipped: {srv.id}, the host's only worker, is not serving (starting or stopping)"
            return
        try:  # a rollout's worker binds a free KV port
            endpoint = httpx.get(srv.url + "/health", timeout=5).json().get("kv_endpoint")
        except (httpx.HTTPError, ValueError):
            endpoint = None
        endpoint = endpoint or f"tcp://{h.ip}:{KV_PORT}"
        s = zmq.Context.instance().socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDTIMEO, 2000)
        try:
            s.connect(endpoint)
            for i in range(200):
                ids = {"request_id": f"soak{i}", "transfer_id": f"soak{i}"}
                for frame in (b"\xc1garbage", pack({"type": PD_DONE, **ids, "token": 1}), pack([1, 2, 3])):
                    try:
                        s.send(frame)
                    except zmq.Again:
                        break
            try:
                s.send(b"\0" * (32 << 20))  # over any frame limit
            except zmq.Again:
                pass
        finally:
            s.close()
        for path in ("/internal/generate", "/internal/role", "/v1/completions"):
            try:
                r = httpx.post(
                    srv.url + path, json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}, timeout=30
                )
            except httpx.ConnectError:
                hw = self.c.agent_worker(f.target, srv.id)
                if hw is not None and hw["alive"] and hw["healthy"]:
                    raise  # its agent says it serves, yet it refused the connection
                # Retired, removed or killed meanwhile (a rollout, the controller, another fault):
                # nothing is left to ask.
                f.note = f"{srv.id} stopped serving meanwhile"
                break
            self.hostile_results.append(f"peer{path}:{r.status_code}")
            if r.status_code not in (401, 403, 404, 405):
                self.violations.append(
                    f"{f.target}{path} without the internal token answered {r.status_code}"
                )
        time.sleep(f.hold)

    # -- rollouts: `pdserve rollout` against router "router", whose fleet asks the host agents

    def rollout(self, f: Fault) -> None:
        """The fleet to the other version (A -> B, then B -> A), canary first. One of its new workers
        killed meanwhile fails its health check, and the rollout rolls back: both end clean."""
        to = self.c.other_version()
        self._rollout(f, to, ["--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000"])

    def rollback(self, f: Fault) -> None:
        """A rollout whose SLO check no version passes: its first new worker is rolled back (when a
        request reaches the new version in its window; with none there is nothing to judge)."""
        self._rollout(f, self.c.other_version(), ["--slo-ttft-ms", "0.001"])

    def _rollout(self, f: Fault, config: Path, flags: list[str]) -> None:
        cmd = pdserve_cmd() + ["rollout", "--config", str(config), "--router", self.c.router.url]
        cmd += ["--admin-key", ADMIN, "--window-s", "4", "--canary-weight", "0.5", "--max-error-rate", "1"]
        cmd += ["--health-timeout-s", "240", "--drain-timeout-s", "5", *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        lines = out.stdout.strip().splitlines()
        f.note = f"{config.stem}: rc {out.returncode}: {lines[-1] if lines else out.stderr.strip()[-200:]}"
        # 0: done; 1: stopped and rolled back (a new worker killed by another fault, an SLO breach).
        # Anything else (a refused admin call, a crash) is a violation, with what it said.
        if out.returncode not in (0, 1) or "Traceback" in out.stderr:
            self.violations.append(
                f"rollout to {config.stem}: rc {out.returncode}: {out.stdout[-800:]} {out.stderr[-800:]}"
            )
        print(f"rollout to {config.stem} ({f.kind} at {f.at:.0f}s):\n{out.stdout}", flush=True)


def probe_kinds(c: SoakCluster, wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    kinds, omitted = list(wanted), dict(OMITTED)
    if isinstance(c.net, LoopbackCluster):
        for k in ("link_down", "router_partition", "slow_link"):
            if k in kinds:
                kinds.remove(k)
                omitted[k] = "loopback hosts share one interface (network namespaces need root)"
    if not c.own_disk and "disk_full" in kinds:
        kinds.remove("disk_full")
        omitted["disk_full"] = "the disk tier needs a small filesystem of its own to fill (a tmpfs: root)"
    try:  # a slow link needs the tbf qdisc
        if "slow_link" not in kinds:
            raise ShapingUnavailable("")
        h = c.host("decode-a")
        c.net.shape(h, 50_000_000)
        c.net.shape(h, None)
    except ShapingUnavailable as e:
        if "slow_link" in kinds:
            kinds.remove("slow_link")
            omitted["slow_link"] = str(e)
    if shutil.which("redis-cli") is None and "redis_restart" in kinds:
        kinds.remove("redis_restart")
        omitted["redis_restart"] = "redis-cli is not installed (it tells when the restarted Redis answers)"
    return kinds, omitted


# ---------------------------------------------------------------------------------------------- main


def _commit() -> str:
    r = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1800, help="seconds of the chaos phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--capacity-s", type=float, default=30, help="seconds of the capacity measurement")
    ap.add_argument("--baseline-s", type=float, default=None, help="fault-free load (default: duration/6)")
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument(
        "--out", type=Path, default=None, help="where the chart and CSV go (default: the workdir)"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--hosts",
        choices=("auto", "netns", "loopback"),
        default="auto",
        help="netns: network-namespace hosts (root); loopback: loopback addresses, without the link "
        "faults; auto: netns where this machine can make them",
    )
    ap.add_argument(
        "--kinds",
        default=",".join(FAULT_KINDS),
        help=f"fault kinds to draw from (default: all of {FAULT_KINDS})",
    )
    args = ap.parse_args(argv)
    seed = args.seed
    wanted = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in wanted if k not in FAULT_KINDS]:
        ap.error(f"--kinds: {bad} are not among {FAULT_KINDS}")
    if shutil.which("redis-server") is None:
        print("chaos_soak: skipped: redis-server is not installed")
        return 0
    why_not = unavailable() if args.hosts != "loopback" else "--hosts loopback"
    if why_not and args.hosts == "netns":
        print(f"chaos_soak: skipped: {why_not}")
        return 0
    loopback = why_not is not None
    if loopback:
        print(f"chaos_soak: hosts on loopback addresses ({why_not})")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    out = args.out or workdir
    out.mkdir(parents=True, exist_ok=True)
    baseline_s = args.baseline_s or max(30.0, min(300.0, args.duration / 6))
    violations: list[str] = []
    print(f"chaos_soak seed={seed} duration={args.duration:.0f}s commit={_commit()} cpu={describe()}")
    t_setup = time.monotonic()
    c = SoakCluster(workdir, disk_mb=24, loopback=loopback)
    try:
        return _soak(c, args, seed, baseline_s, out, violations, t_setup, wanted)
    finally:
        c.close()


def _soak(
    c: SoakCluster,
    args,
    seed: int,
    baseline_s: float,
    out: Path,
    violations: list[str],
    t0: float,
    wanted: list[str],
) -> int:
    what = "loopback" if isinstance(c.net, LoopbackCluster) else "namespace"
    print(f"deployment up in {time.monotonic() - t0:.0f}s ({what} hosts: {', '.join(c.net.hosts)})")
    kinds, omitted = probe_kinds(c, wanted)
    for k, why in omitted.items():
        print(f"fault kind left out: {k}: {why}")
    sampler = Sampler(c, t0)
    sampler.start()
    marks: dict[str, float] = {}
    pool = request_pool(seed)

    # 1. references, fault-free
    refs: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for spec, r in zip(pool, ex.map(lambda s: send_until_admitted(c.router.url, s), pool)):
            if r.status != 200 or r.why:
                violations.append(f"reference {spec.key} (fault-free) failed: {r.status} {r.why}")
            elif spec.greedy:
                refs[spec.key] = r.text
    if violations:
        return _report(violations, seed)
    load = Load(c, pool, refs, seed)

    # 2. capacity: a closed loop at a few concurrencies, briefly
    cap, per = 0.0, args.capacity_s / 3
    for conc in (2, 4, 8):
        rs = load.closed_loop(conc, per)
        g = goodput(rs, per)
        ttfts = sorted(r.ttft for r in rs if r.ttft is not None)
        p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
        print(f"capacity: concurrency {conc}: {len(rs)} requests, goodput {g:.2f}/s, TTFT p90 {p90:.2f}s")
        cap = max(cap, g)
    if cap <= 0:
        violations.append("capacity: no request met the SLO fault-free")
        return _report(violations, seed)
    rate = 2 * cap
    print(
        f"capacity {cap:.2f} req/s within TTFT {SLO_TTFT_S}s; load: {rate:.2f} req/s (Poisson), both routers"
    )

    # 3. baseline: the same load, no faults
    n0 = len(load.results)
    tb = time.monotonic()
    load.open_loop(rate, baseline_s)
    load.wait_idle(DEADLINE_S + 10)
    base_results = load.results[n0:]
    base_good = goodput(base_results, baseline_s)
    base_ok = goodput(base_results, baseline_s, slo=False)
    marks["baseline end"] = time.monotonic() - t0
    sampler.sample()
    warm = {
        (n, srv.proc.pid): proc_stats(srv.proc.pid, not n.startswith("agent-")) for n, srv in c.procs.items()
    }
    for n in ("router", "router-b"):
        print(f"{n} TCP sockets after the baseline: {tcp_tally(c, n, c.procs[n].proc.pid)}")
    print(
        f"baseline ({baseline_s:.0f}s, no faults): {len(base_results)} requests, "
        f"{_counts(base_results)}, goodput {base_good:.2f}/s, right answers {base_ok:.2f}/s "
        f"({time.monotonic() - tb:.0f}s)"
    )

    # 4. chaos
    plan = schedule(seed, args.duration, kinds)
    print(f"fault schedule (seed {seed}):")
    for f in plan:
        print("  " + f.line())
    chaos = Chaos(c, violations, seed)
    n1 = len(load.results)
    tc = time.monotonic()
    marks["chaos"] = tc - t0
    threads = [threading.Thread(target=chaos.run, args=(f, tc), daemon=True) for f in plan]
    for t in threads:
        t.start()
    load.open_loop(rate, args.duration)
    marks["drain"] = time.monotonic() - t0

    # 5. drain: faults lifted (each restores its own), the load's last answers in, workers idle
    for t in threads:
        t.join(timeout=max(1.0, 420 - (time.monotonic() - tc - args.duration)))
        if t.is_alive():
            violations.append("a fault did not finish within 420 s of the chaos phase's end")
    if not load.wait_idle(DEADLINE_S + 30):
        violations.append(f"client requests still in flight {DEADLINE_S + 30:.0f}s after the load stopped")
    load.exe.shutdown(wait=False)
    try:
        c.wait_live_healthy(timeout=120)
    except AssertionError as e:
        violations.append(f"after the drain: {e}")
    # The fleet the controller keeps (min = max): processes beyond it after the drain are workers
    # nobody stops (a restart racing a retire, a rollout replacing a dead entry). One the controller
    # added for a worker that was down goes once the pools are cold: it is given that long.
    want = OVERRIDES["controller"]["max_workers"]
    settle = time.monotonic() + 120
    while True:
        c.refresh_all()
        running = sorted(n for n in c.procs if "/" in n)
        if len(running) == want or time.monotonic() > settle:
            break
        time.sleep(SAMPLE_S)
    if len(running) != want:
        violations.append(
            f"{len(running)} worker processes after the drain, not {want}: {', '.join(running)}; "
            + "; ".join(_last_decisions(c))
        )
    leaked = held_blocks(c, violations)
    if leaked:
        violations.append(f"{leaked} KV blocks still held after the drain")
    time.sleep(2 * SAMPLE_S)
    sampler.sample()
    sampler.stop.set()
    t_end = time.monotonic() - t0

    chaos_results = load.results[n1:]
    for r in chaos_results:
        if r.outcome == "violation":
            violations.append(f"request {r.spec} via {r.router} at {r.start - tc:.1f}s: {r.why}")
    print(f"chaos ({args.duration:.0f}s): {len(chaos_results)} requests, {_counts(chaos_results)}")
    print(f"requests not sent (client cap {CLIENT_CAP} in flight): {load.capped}")
    print(f"hostile: {_tally(chaos.hostile_results)}")
    print("fault log:")
    for f in plan:
        span = (
            f"ran {f.began:.1f}-{f.ended:.1f}s"
            if f.began is not None and f.ended is not None
            else "did not run"
        )
        print(f"  {f.line()} {span}")

    # Both routers run the controller; the lease in Redis lets one act at a time (a Redis restart
    # may hand it to the other).
    acted = []
    for n in ("router", "router-b"):
        try:
            ds = _admin(c, "GET", "/admin/controller", router=n).json()
        except (httpx.HTTPError, KeyError, ValueError) as e:
            violations.append(f"{n}: GET /admin/controller failed: {e}")
            continue
        moves = [d for d in ds if d["action"] != "hold"]
        waits = sum(1 for d in ds if d["action"] == "hold" and "lease" in d["reason"])
        acted.append(
            f"{n} {len(moves)} actions ({', '.join(sorted({d['action'] for d in moves})) or '-'}), "
            f"{waits} readings without the lease"
        )
    print("controllers: " + "; ".join(acted))

    # goodput while each kind was active, against the baseline
    ratios = {}
    for kind in kinds:
        # Only while the load ran: a fault still running after the chaos phase saw no requests then.
        spans = [
            (f.began, min(f.ended, args.duration))
            for f in plan
            if f.kind == kind and f.began is not None and f.ended and f.began < args.duration
        ]
        secs = sum(b - a for a, b in spans)
        rs = [r for r in chaos_results if any(a <= r.start - tc <= b for a, b in spans)]
        ratios[kind] = (
            goodput(rs, secs) / base_good if secs and base_good else float("nan"),
            goodput(rs, secs, slo=False) / base_ok if secs and base_ok else float("nan"),
            len(rs),
        )
    quiet = [
        r
        for r in chaos_results
        if not any(f.began is not None and f.ended and f.began <= r.start - tc <= f.ended for f in plan)
    ]
    print(
        f"with faults / without: goodput (TTFT <= {SLO_TTFT_S}s; baseline {base_good:.2f}/s) and right "
        f"answers (baseline {base_ok:.2f}/s), per fault kind active:"
    )
    for kind, (g, ok, n) in ratios.items():
        if not n:
            print(f"  {kind:<18} (no request started while it was active during the load)")
            continue
        print(f"  {kind:<18} goodput {g:5.2f}  right answers {ok:5.2f}  ({n} requests)")
    whole = (
        goodput(chaos_results, args.duration) / base_good if base_good else float("nan"),
        goodput(chaos_results, args.duration, slo=False) / base_ok if base_ok else float("nan"),
    )
    print(f"  {'whole chaos phase':<18} goodput {whole[0]:5.2f}  right answers {whole[1]:5.2f}")
    print(f"  (requests started while no fault was active: {len(quiet)})")

    # memory, fds and threads of every process that lived from warm-up to the end
    print(
        f"{'process':<10} {'pid':>8} {'RSS warm MiB':>13} {'end MiB':>8} {'growth':>7} {'fds':>9} {'threads':>9}"
    )
    for name, srv in c.procs.items():
        key = (name, srv.proc.pid)
        end = proc_stats(srv.proc.pid, not name.startswith("agent-"))
        if end is None:
            violations.append(f"{name} (pid {srv.proc.pid}) is not running after the drain")
            continue
        # Warm-up: the baseline and the first third of the chaos phase, so that one-time growth (a
        # code path's first use, a fault's first recovery) is behind it and what follows is a trend.
        warm_at = marks["chaos"] + args.duration / 3
        base = sampler.last(name, srv.proc.pid, warm_at) if key in warm else None
        note = ""
        if base is None:  # restarted during the chaos
            first = [r for r in sampler.rows if r[1] == name and r[2] == srv.proc.pid]
            # its warm-up: the first third of its life (at least 30 s), as for the others
            span = max(30.0, (t_end - first[0][0]) / 3) if first else 0.0
            later = [r for r in first if r[0] >= first[0][0] + span] if first else []
            if not later:
                print(f"{name:<10} {srv.proc.pid:>8} restarted too late to have a warm-up value")
                continue
            base, note = later[0][3:], f" (restarted; warm-up its first {span:.0f} s)"
        growth = end[0] / base[0] - 1
        print(
            f"{name:<10} {srv.proc.pid:>8} {base[0] / 2**20:13.1f} {end[0] / 2**20:8.1f} {growth:+7.1%} "
            f"{base[1]:>4}->{end[1]:<4} {base[2]:>4}->{end[2]:<4}{note}"
        )
        if growth > args.rss_tolerance:
            violations.append(f"{name}: RSS grew {growth:+.1%} over its post-warm-up value")
        # Redis's fds and threads are its clients' pooled connections (the routers' and workers'
        # pools grow with concurrency, reconnect after its restart): its memory is checked, not them.
        # A router's Redis pool (shared limits) fills up to its bound under load and stays: bounded,
        # so not a leak; anything past it is.
        slack = FD_SLACK + (REDIS_POOL if name.startswith("router") else 0)
        if name != "redis" and end[1] > base[1] + slack:
            violations.append(
                f"{name}: {end[1]} fds after the drain, {base[1]} after warm-up; its TCP sockets by "
                f"state and peer: {tcp_tally(c, name, srv.proc.pid)}"
            )
        if name != "redis" and end[2] > base[2] + THREAD_SLACK:
            violations.append(f"{name}: {end[2]} threads after the drain, {base[2]} after warm-up")
    marks["warm-up end"] = marks["chaos"] + args.duration / 3
    marks["end"] = t_end
    print(f"memory chart: {chart(sampler.rows, out, marks)}")
    return _report(violations, seed)


def _counts(rs: list[Result]) -> str:
    return _tally([r.outcome for r in rs])


def _tally(xs: list[str]) -> str:
    counts: dict[str, int] = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _report(violations: list[str], seed: int) -> int:
    if not violations:
        print(f"chaos_soak seed={seed}: no violations")
        return 0
    print(f"chaos_soak seed={seed}: {len(violations)} violations (rerun with --seed {seed} to reproduce):")
    for v in violations:
        print("  VIOLATION " + v)
    return 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # close() tears the hosts down
    sys.exit(main())
