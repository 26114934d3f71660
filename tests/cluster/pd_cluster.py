"""A PD deployment across namespace hosts: two router replicas, two prefill and two decode hosts, a
Redis host (the KV tier every worker shares). Each worker binds its host's address, registers
itself with both routers (`--router-url a,b`) and sends heartbeats; each router learns the workers'
KV endpoints and KV-event endpoints from /health and feeds its index over the network.
`transfer.backend` is left at its default, `auto`. The tests send their traffic through "router"."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from cluster.cluster_hosts import Cluster, Host, LoopbackCluster, wait_until

from pdserve.bench.procs import ServerProcess, pdserve_cmd, thread_env

MODEL = "tiny-qwen2"  # random weights, fast; greedy output depends on the KV (tiny-llama's does not)
TOKEN = "cluster-internal-token"
ADMIN = "cluster-admin-key"  # routers listen off loopback: they need one (and /admin/* takes only it)
PORT, KV_PORT, EVENTS_PORT, REDIS_PORT = 8000, 5556, 5557, 6379
ROLES = {"prefill-a": "prefill", "prefill-b": "prefill", "decode-a": "decode", "decode-b": "decode"}
# prefill-b sends KV at this rate (transfer.bandwidth_limit): a slow link, and a transfer long enough
# (a 400-token prompt of tiny-qwen2 is ~200 KB) to cut mid-way.
SLOW_PREFILL, SLOW_BYTES_PER_S = "prefill-b", 256_000

CONFIG = {
    "model": {"name": MODEL},
    "cache": {"device_blocks": 256, "block_size": 16},
    "server": {"internal_token": TOKEN, "shutdown_timeout_s": 5},
    # Short deadlines keep the faults quick; generous enough for a loaded 2-core machine.
    "disagg": {
        "bootstrap_timeout_s": 4,
        "transfer_timeout_s": 6,
        "queue_timeout_s": 30,
        "peer_retry_s": 5,
        "local_prefill_max_tokens": 16,
    },
    "router": {
        "admin_keys": [ADMIN],
        "health_period_s": 0.5,
        "heartbeat_timeout_s": 3,
        "connect_timeout_s": 2,
        "max_retries": 3,
        "breaker_failures": 3,
        "breaker_cooldown_s": 2,
    },
}


def prompt(i: int, n: int = 80) -> list[int]:
    """Token-id prompts (no tokenizer between the test and the workers), each unique."""
    return [(131 * i + 17 * j) % 5000 + 10 for j in range(n)]


@dataclass
class Outcome:
    text: str = ""
    chunks: int = 0
    max_gap: float = 0.0  # the longest the client waited for a chunk (first one included)
    error: str | None = None
    seconds: float = 0.0
    times: list[float] = field(default_factory=list)  # each chunk's arrival (time.monotonic())


def stream_completion(
    url: str,
    p: list[int],
    max_tokens: int,
    on_token=None,
    timeout: float = 60,
    headers: dict | None = None,
    model: str = MODEL,
) -> Outcome:
    """One streamed greedy completion from `url` (the official client); `on_token(n)` after each
    chunk with the chunks so far."""
    out, t0 = Outcome(), time.monotonic()
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout, default_headers=headers
    )
    try:
        chunks = client.completions.create(
            model=model,
            prompt=p,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, last = [], t0
        for c in chunks:
            parts.append(c.choices[0].text if c.choices else "")
            out.chunks += 1
            now = time.monotonic()
            out.times.append(now)
            out.max_gap, last = max(out.max_gap, now - last), now
            if on_token is not None:
                on_token(out.chunks)
        out.text = "".join(parts)
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


def recovery_s(outs: list[Outcome], fault_at: float) -> float:
    """Time to recover from a fault at `fault_at`: until the longest stall after it ended. Over the
    streams still running at the fault, the longest wait for a chunk after it (the fault opens the
    first wait; chunks already on their way arrive first) is the fault's: a stream waiting for its
    migration, retry or local prefill; its end is when every stream moved again. 0.0 when no
    stream was running at the fault."""
    longest, end = 0.0, fault_at
    for o in outs:
        prev = fault_at
        for t in (t for t in o.times if t > fault_at):
            if t - prev > longest:
                longest, end = t - prev, t
            prev = t
    return end - fault_at


class PDCluster:
    def __init__(
        self,
        workdir: Path,
        redis: bool = True,
        otlp_port: int | None = None,
        overrides: dict | None = None,
        loopback: bool = False,
    ) -> None:
        """`loopback`: hosts are loopback addresses (cluster_hosts.LoopbackCluster: no root, no link faults)."""
        self.overrides = overrides or {}  # config sections merged over CONFIG's (e.g. a soak's limits)
        self.otlp_port = (
            otlp_port  # every process exports its trace spans to this port of the test host (None: off)
        )
        names = (
            ["router", *ROLES] + (["redis"] if redis and shutil.which("redis-server") else []) + ["router-b"]
        )
        self.net: Cluster | LoopbackCluster = (LoopbackCluster if loopback else Cluster)(names, workdir)
        self.workdir = workdir
        self.procs: dict[str, ServerProcess] = {}
        self.receiver: Any = None  # the OTLP receiver (tests/otlp_receiver.py) when tracing is on
        try:
            self._start(redis)
        except BaseException:
            self.net.close()
            raise

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    @property
    def router(self) -> ServerProcess:
        return self.procs["router"]

    def _start(self, redis: bool) -> None:
        cfg = dict(CONFIG)
        for section, values in self.overrides.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        if self.otlp_port:  # a receiver in the test process: every host reaches it at the bridge's address
            cfg["server"] = {**cfg["server"], "otlp_endpoint": f"http://{self.net.gateway}:{self.otlp_port}"}
        if "redis" in self.net.hosts:
            h = self.host("redis")
            self.redis_url = f"redis://{h.ip}:{REDIS_PORT}/0"
            cfg["cache"] = {**cfg["cache"], "remote": self.redis_url}
            if cfg["router"].get("shared_limits") is True:  # an override asking for this cluster's Redis
                cfg["router"] = {**cfg["router"], "shared_limits": self.redis_url}
            srv = self.start_redis()
            self.procs["redis"] = srv
        self.cfg = cfg
        self.config_path = self.workdir / "pdserve.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.slow_config_path = self.workdir / "pdserve-slow.yaml"
        self.slow_config_path.write_text(
            yaml.safe_dump({**cfg, "transfer": {"bandwidth_limit": SLOW_BYTES_PER_S}})
        )
        for name in ("router", "router-b"):  # two replicas; the tests' traffic goes through "router"
            r = self.host(name)
            self.procs[name] = self.net.start(
                r,
                name,
                pdserve_cmd()
                + ["router", "--config", str(self.router_config(name)), "--host", r.ip, "--port", str(PORT)],
                PORT,
                env=thread_env(1),
                health_path="/metrics",
            )
        for name in ROLES:
            self.start_worker(name)
        self.router.wait_ready(timeout=120)
        self.procs["router-b"].wait_ready(timeout=120)
        for name in ROLES:
            self.procs[name].wait_ready(timeout=300)
        self.wait_healthy(set(ROLES))

    def router_config(self, name: str) -> Path:
        """The config file a router replica starts with (a subclass may give each its own)."""
        return self.config_path

    def start_redis(self) -> ServerProcess:
        """Start (or restart, on the same host and port) the Redis server; wait_ready() it."""
        h = self.host("redis")
        n = len(h.procs)
        cmd = ["redis-server", "--bind", h.ip, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"]
        cmd += ["--protected-mode", "no", "--dir", str(self.workdir)]
        srv = self.procs["redis"] = self.net.start(h, "redis" if not n else f"redis-{n + 1}", cmd, REDIS_PORT)
        return srv

    def worker_config(self, name: str, starts: int, transfer: dict | None) -> Path:
        """The config file a worker starts with (a subclass may give each worker its own)."""
        config = self.slow_config_path if name == SLOW_PREFILL else self.config_path
        if transfer is not None:
            config = self.workdir / f"pdserve-{name}-{starts + 1}.yaml"
            config.write_text(yaml.safe_dump({**self.cfg, "transfer": transfer}))
        return config

    def start_worker(self, name: str, transfer: dict | None = None) -> ServerProcess:
        """Start (or restart: a fresh process, the same host, ports and name) a worker; `transfer`
        replaces the config's transfer section for this process."""
        h = self.host(name)
        starts = len(h.procs)
        config = self.worker_config(name, starts, transfer)
        cmd = pdserve_cmd() + [
            "worker",
            "--role",
            ROLES[name],
            "--config",
            str(config),
            "--host",
            h.ip,
            "--port",
            str(PORT),
            "--kv-port",
            str(KV_PORT),
            "--kv-events-endpoint",
            f"tcp://{h.ip}:{EVENTS_PORT}",
            "--router-url",
            f"{self.host('router').url(PORT)},{self.host('router-b').url(PORT)}",
            "--threads",
            "1",
        ]
        log = name if not starts else f"{name}-{starts + 1}"
        srv = self.procs[name] = self.net.start(h, log, cmd, PORT, env=thread_env(1))
        return srv

    def log_sizes(self) -> dict[str, int]:
        """Where each current process's log ends now: a mark for `warnings_since`."""
        return {n: srv.log_path.stat().st_size for n, srv in self.procs.items() if srv.log_path.exists()}

    def warnings_since(self, mark: dict[str, int], names=tuple(ROLES)) -> list[str]:
        """The WARNING/ERROR lines the named processes logged after `mark`: what a failed fault
        assertion prints, so a CI log says why a transfer failed."""
        lines = []
        for n in names:
            path = self.procs[n].log_path
            with path.open("rb") as f:
                f.seek(mark.get(n, 0))
                lines += [
                    f"{n}: {x}"
                    for x in f.read().decode(errors="replace").splitlines()
                    if " WARNING " in x or " ERROR " in x
                ]
        return lines

    # ------------------------------------------------------------------ the router's view

    def workers(self, router: str = "router") -> dict[str, dict]:
        """A router's /admin/workers keyed by host name (a worker's URL names its host's address)."""
        by_ip = {h.ip: n for n, h in self.net.hosts.items()}
        out = {}
        for w in httpx.get(
            self.procs[router].url + "/admin/workers", timeout=5, headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()["workers"]:
            out[by_ip[httpx.URL(w["url"]).host]] = w
        return out

    def wait_healthy(self, names: set[str], timeout: float = 60, routers=("router", "router-b")) -> None:
        wait_until(
            lambda: all(self.workers(r).get(n, {}).get("healthy") for n in names for r in routers),
            timeout,
            f"workers {sorted(names)} healthy at the routers",
        )

    def health(self, name: str) -> dict:
        return httpx.get(self.procs[name].url + "/health", timeout=5).json()

    def idle_pools(self, names=tuple(ROLES), timeout: float = 60) -> None:
        """Every named worker idle with its whole KV pool free (cached blocks count as free)."""

        def idle() -> bool:
            for n in names:
                h = self.health(n)
                busy = h["running"] or h["waiting"] or h["loading"] or h.get("kv_blocks_quarantined", 0)
                if busy or h["kv_blocks_free"] != h["kv_blocks_total"] or h.get("kv_prefill_jobs_active", 0):
                    return False
            return True

        wait_until(
            idle,
            timeout,
            f"idle pools on {list(names)}: " + "; ".join(f"{n}={self._pool_line(n)}" for n in names),
        )

    def leaked_blocks(self, names=tuple(ROLES), timeout: float = 60) -> int:
        """KV blocks still held on the named workers (neither free nor cached) once they are idle:
        waits up to `timeout` for every pool to return to its start, then counts what did not."""
        try:
            self.idle_pools(names, timeout)
        except AssertionError as e:
            print(e)
        return sum(h["kv_blocks_total"] - h["kv_blocks_free"] for h in map(self.health, names))

    def _pool_line(self, name: str) -> str:
        try:
            h = self.health(name)
        except httpx.HTTPError as e:
            return repr(e)
        return (
            f"free {h['kv_blocks_free']}/{h['kv_blocks_total']} running {h['running']} waiting {h['waiting']} "
            f"loading {h['loading']}"
        )

    # ------------------------------------------------------------------ load

    def client(
        self, timeout: float = 60, router: str = "router", headers: dict | None = None
    ) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.procs[router].url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout,
            default_headers=headers,
        )

    def stream(
        self,
        p: list[int],
        max_tokens: int,
        on_token=None,
        timeout: float = 60,
        router: str = "router",
        headers: dict | None = None,
    ) -> Outcome:
        """One streamed greedy completion through the router (the official client); `on_token(n)`
        after each chunk with the chunks so far. `router` may name a worker, reached directly (with
        the internal token and the prefill peer in `headers`, as the router sends them)."""
        return stream_completion(self.procs[router].url, p, max_tokens, on_token, timeout, headers)

    def load(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        fault=None,
        fault_after: int = 8,
        timeout: float = 60,
        routers=("router",),
        headers: dict | None = None,
        watch=None,
    ) -> list[Outcome]:
        """Stream every prompt at once (through `routers` in turn); `fault()` runs once, when any
        stream has `fault_after` tokens, or, given `watch`, as fault(found) as soon as watch()
        returns something once a stream has them (polled from its own thread: the workers' state,
        which a client short of CPU can read its chunks far behind; before any stream has tokens
        a fault meets requests the router retries, not streams it migrates). With fault_after=0
        `watch` is polled from the start: it judges the workers' state alone."""
        fired, armed = threading.Event(), threading.Event()
        if fault_after <= 0:
            armed.set()

        def on_token(n: int) -> None:
            if n >= fault_after:
                armed.set()
            if fault is not None and watch is None and n >= fault_after and not fired.is_set():
                fired.set()
                fault()

        with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
            futs = [
                pool.submit(self.stream, p, max_tokens, on_token, timeout, routers[i % len(routers)], headers)
                for i, p in enumerate(prompts)
            ]
            watcher = (
                pool.submit(self._watch, watch, fault, fired, armed, futs) if watch is not None else None
            )
            outs = [f.result() for f in futs]
            if watcher is not None:
                watcher.result()  # its failure is the test's
        assert fault is None or fired.is_set(), (
            "the fault never fired: the streams were too short",
            [(o.chunks, o.error) for o in outs],
        )
        return outs

    @staticmethod
    def _watch(watch, fault, fired: threading.Event, armed: threading.Event, futs: list) -> None:
        while not all(f.done() for f in futs):
            if not armed.wait(0.02):
                continue
            found = watch()
            if found is not None:
                fired.set()
                fault(found)  # at once: the state found can end within a poll's time
                return
            time.sleep(0.02)

    def close(self) -> None:
        self.net.close()
