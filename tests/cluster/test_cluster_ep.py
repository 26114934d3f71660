"""Expert parallelism across hosts (network namespaces): a decode worker whose EP=2 ranks live on two
hosts (rank 0 in the worker on ep-a, rank 1 a `pdserve ep-rank` on ep-b, meeting at ep-a's
rendezvous), behind a router with an EP=1 prefill worker. The KV a prefill host sends lands in rank
0's pool; the rank that attends a sequence on the other host gets its blocks over the link
(model/ep_kv.py). Then the link between the two EP hosts is cut under streaming load: the worker
fails by its deadline, and the router finishes every stream on the other decode host."""

from __future__ import annotations

import concurrent.futures
import functools
import subprocess
import threading
import time

import httpx
import pytest
import yaml
from cluster.cluster_hosts import Cluster, unavailable, wait_until
from cluster.figures import record, timed
from cluster.pd_cluster import ADMIN, CONFIG, KV_PORT, PORT, Outcome, prompt, recovery_s, stream_completion

from pdserve.bench.procs import ServerProcess, pdserve_cmd, thread_env

pytestmark = pytest.mark.slow
MODEL = "tiny-mixtral"
HOSTS = ["router", "prefill", "ep-a", "ep-b", "solo"]
RENDEZVOUS_PORT = 29500
MAX_TOKENS = 32
FAULT_TOKENS = 256
# The EP worker's deadline: the cut shows by it; long enough for a loaded 2-core machine's healthy ranks.
EP_TIMEOUT_S = 10


class EPCluster:
    def __init__(self, workdir) -> None:
        self.net = Cluster(HOSTS, workdir)
        self.workdir = workdir
        self.procs: dict[str, ServerProcess] = {}
        self.rank1: subprocess.Popen | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg = {**CONFIG, "model": {"name": MODEL}, "cache": {"device_blocks": 160, "block_size": 16}}
        self.config = self.workdir / "pdserve.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        a = self.net.hosts["ep-a"]
        ep = {
            **cfg["model"],
            "expert_parallel": 2,
            "ep_local_ranks": 1,
            "ep_rendezvous": f"{a.ip}:{RENDEZVOUS_PORT}",
            "ep_timeout_s": EP_TIMEOUT_S,
        }
        self.ep_config = self.workdir / "pdserve-ep.yaml"
        self.ep_config.write_text(yaml.safe_dump({**cfg, "model": ep}))
        r = self.net.hosts["router"]
        self.procs["router"] = self.net.start(
            r,
            "router",
            pdserve_cmd() + ["router", "--config", str(self.config), "--host", r.ip, "--port", str(PORT)],
            PORT,
            env=thread_env(1),
            health_path="/metrics",
        )
        # Rank 1 first: it waits at the rendezvous for rank 0 (the worker on ep-a), as a pod would.
        b = self.net.hosts["ep-b"]
        cmd = pdserve_cmd() + ["ep-rank", "--rank", "1", "--role", "decode", "--config", str(self.ep_config)]
        self.rank1_log = open(self.workdir / "ep-b.log", "wb")
        self.rank1 = subprocess.Popen(
            self.net.wrap(b, cmd), stdout=self.rank1_log, stderr=subprocess.STDOUT, env=thread_env(1)
        )
        self.start_worker("prefill", "prefill", self.config)
        self.start_worker("ep-a", "decode", self.ep_config)
        for name in ("router", "prefill", "ep-a"):
            self.procs[name].wait_ready(timeout=300)
        self.wait_healthy({"prefill", "ep-a"})

    def start_worker(self, name: str, role: str, config) -> ServerProcess:
        h = self.net.hosts[name]
        cmd = pdserve_cmd() + ["worker", "--role", role, "--config", str(config), "--host", h.ip]
        cmd += ["--port", str(PORT), "--kv-port", str(KV_PORT), "--threads", "1"]
        cmd += ["--router-url", self.net.hosts["router"].url(PORT)]
        srv = self.procs[name] = self.net.start(h, name, cmd, PORT, env=thread_env(1))
        return srv

    def leaked_blocks(self, names: tuple[str, ...], timeout: float = 60) -> int:
        """KV blocks the named workers still hold (neither free nor cached) once they are idle."""

        def health(n: str) -> dict:
            return httpx.get(self.procs[n].url + "/health", timeout=5).json()

        def idle() -> bool:
            return all(
                not (h := health(n))["running"]
                and not h["waiting"]
                and h["kv_blocks_free"] == h["kv_blocks_total"]
                for n in names
            )

        try:
            wait_until(idle, timeout, f"idle pools on {list(names)}")
        except AssertionError as e:
            print(e)
        return sum(h["kv_blocks_total"] - h["kv_blocks_free"] for h in map(health, names))

    def workers(self) -> dict[str, dict]:
        by_ip = {h.ip: n for n, h in self.net.hosts.items()}
        got = httpx.get(
            self.procs["router"].url + "/admin/workers",
            timeout=5,
            headers={"Authorization": f"Bearer {ADMIN}"},
        ).json()["workers"]
        return {by_ip[httpx.URL(w["url"]).host]: w for w in got}

    def wait_healthy(self, names: set[str], timeout: float = 120) -> None:
        wait_until(
            lambda: all(self.workers().get(n, {}).get("healthy") for n in names),
            timeout,
            f"{sorted(names)} healthy",
        )

    def stream(self, p: list[int], max_tokens: int, on_token=None) -> Outcome:
        return stream_completion(self.procs["router"].url, p, max_tokens, on_token, timeout=120, model=MODEL)

    def load(self, prompts: list[list[int]], max_tokens: int, on_token=None) -> list[Outcome]:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.stream(p, max_tokens, on_token), prompts))

    def close(self) -> None:
        self.net.close()
        if self.rank1 is not None:
            self.rank1.kill()
            self.rank1.wait(10)
            self.rank1_log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with timed("EP across hosts (test_cluster_ep.py)"):
        c = EPCluster(tmp_path_factory.mktemp("ep-cluster"))
        try:
            yield c
        finally:
            c.close()


@functools.lru_cache(maxsize=None)
def want(i: int, max_tokens: int) -> str:
    """The greedy text of prompt(i) from the offline engine at EP=1."""
    from pdserve import SamplingParams

    llm = _offline()
    return llm.generate(prompt(i), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[
        0
    ].text


@functools.lru_cache(maxsize=None)
def _offline():
    from pdserve import LLM

    return LLM(model=MODEL, threads=1)


def test_a_decode_worker_with_ranks_on_two_hosts_gives_ep1_tokens(cluster):
    """PD with prefill EP=1 and decode EP=2 across hosts: every greedy text equals EP=1's, and the
    decode worker moved KV to its other host's rank and back."""
    outs = cluster.load([prompt(i) for i in range(6)], MAX_TOKENS)
    assert [o.error for o in outs] == [None] * 6
    assert [o.text for o in outs] == [want(i, MAX_TOKENS) for i in range(6)]
    assert cluster.workers()["ep-a"]["requests"] >= 6
    assert cluster.rank1.poll() is None


def test_a_cut_between_the_ep_hosts_fails_the_worker_and_loses_no_request(cluster):
    """The link between rank 0's host and rank 1's is cut while streams run on the worker (packets
    vanish, no reset): the worker's next exchange misses its deadline, its /health turns engine_dead,
    and the router finishes every stream on the other decode host: 0 lost, every text EP=1's."""
    cluster.start_worker("solo", "decode", cluster.config).wait_ready(timeout=300)
    cluster.wait_healthy({"solo", "ep-a"})
    a, b = cluster.net.hosts["ep-a"], cluster.net.hosts["ep-b"]
    fired = threading.Event()
    before = cluster.workers()["ep-a"]["requests"]

    at: list[float] = []

    def on_token(n: int) -> None:
        if n >= 8 and not fired.is_set():
            fired.set()
            at.append(time.monotonic())
            cluster.net.cut(a, b)

    try:
        outs = cluster.load([prompt(i) for i in range(10, 16)], FAULT_TOKENS, on_token)
        assert fired.is_set()
        assert cluster.workers()["ep-a"]["requests"] > before  # some streams ran on the EP worker
        assert [o.error for o in outs] == [None] * 6
        assert [o.text for o in outs] == [want(i, FAULT_TOKENS) for i in range(10, 16)]
        health = httpx.get(cluster.procs["ep-a"].url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead", health.text
        wait_until(lambda: not cluster.workers()["ep-a"]["healthy"], 30, "the router to mark ep-a unhealthy")
        leaked = cluster.leaked_blocks(("prefill", "solo"))
        record(
            "a cut between a decode worker's two EP hosts (its streams retried or migrated)",
            sum(o.error is None for o in outs),
            sum(o.error is not None for o in outs),
            recovery_s(outs, at[0]),
            leaked,
            f"model.ep_timeout_s {EP_TIMEOUT_S}; the EP worker's /health: {health.json()['error']['code']}",
        )
        assert leaked == 0
    finally:
        cluster.net.cut(a, b, cut=False)
