"""Hosts made of Linux namespaces: a small cluster on one machine, for tests across real network links.

Each host is a network namespace with its own address on a bridge (the test process reaches every
host through the bridge's own address), plus, for each process started on it, its own UTS namespace
(hostname) and mount namespace with a private /dev/shm: a process on one host cannot map another
host's shared-memory pool or look a peer's pid up by hostname, so the KV moves over tcp and liveness
is only what the network says, as between real machines. Faults are shaped without netem (not in
every kernel): a host's link goes down (its bridge port: packets vanish, no reset is sent), a
process is stopped (SIGSTOP: alive, sockets open, silent), two hosts lose the path between them
alone (a route into the void), or a link is slowed (a tbf token bucket, where
the kernel has it).

Needs root and iproute2; `unavailable()` says why not, for a skip. Everything built is torn down by
`close()`, which is safe to call after a partial build and runs at interpreter exit as a last resort.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.procs import ServerProcess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2 / util-linux) is not installed"
    probe = f"pdprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"cannot create a network namespace: {r.stderr.strip()}"
        r = _ip("link", "add", f"{probe[:10]}b", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge: {r.stderr.strip()}"
        _ip("link", "del", f"{probe[:10]}b", check=False)
        r = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            return f"cannot give a process its own hostname and mounts: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class ShapingUnavailable(RuntimeError):
    """This kernel (or tc) cannot shape a link."""


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    port_dev: str  # the bridge side of its veth pair: down = link down
    procs: list[ServerProcess] = field(default_factory=list)

    def url(self, port: int) -> str:
        return f"http://{self.ip}:{port}"


class Cluster:
    """Namespaces on one bridge, named with this process's tag so parallel runs do not collide."""

    def __init__(self, host_names: list[str], workdir: Path, shm_mb: int = 512) -> None:
        self.shm_mb = shm_mb  # each process's private /dev/shm (its KV pool lives there)
        self.tag = f"{os.getpid() % 0xFFFFF:x}"
        self.bridge = f"pdbr{self.tag}"
        net = 100 + os.getpid() % 150
        self.gateway = f"10.231.{net}.1"
        self.void = f"10.231.{net}.250"  # no host answers here: routes through it lead nowhere
        self.workdir = workdir
        self.hosts: dict[str, Host] = {}
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(host_names):
                self._add_host(name, f"10.231.{net}.{10 + i}", i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, ip: str, i: int) -> None:
        ns, outer, inner = f"pdc{self.tag}-{name}", f"pdv{self.tag}{i}", f"pdp{self.tag}{i}"
        host = self.hosts[name] = Host(
            name, ns, ip, outer
        )  # registered first: close() removes a half-made one
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        assert host.ip == ip

    # ------------------------------------------------------------------ processes

    def wrap(self, host: Host, cmd: list[str]) -> list[str]:
        """`cmd` run on `host`: its network namespace, its own hostname and a private /dev/shm."""
        script = f'hostname "$0" && mount -t tmpfs -o size={self.shm_mb}m pdshm /dev/shm && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            host.ns,
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            f"{host.name}-{self.tag}",
            *cmd,
        ]

    def start(
        self,
        host: Host,
        name: str,
        cmd: list[str],
        port: int,
        env: dict | None = None,
        health_path: str = "/health",
    ) -> ServerProcess:
        """A server on `host` listening on its address at `port` (wait_ready() it)."""
        srv = ServerProcess(
            self.wrap(host, cmd), port, self.workdir / f"{name}.log", env=env, health_path=health_path
        )
        srv.url = host.url(port)
        host.procs.append(srv)
        return srv

    def run(self, host: Host, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", host.ns, *cmd], capture_output=True, text=True, timeout=timeout
        )

    # ------------------------------------------------------------------ faults

    def link(self, host: Host, up: bool) -> None:
        """Take the host's link down (its bridge port: every packet to or from it vanishes, as in a
        partition; sockets stay open on both sides) or bring it back."""
        _ip("link", "set", host.port_dev, "up" if up else "down")

    def cut(self, a: Host, b: Host, cut: bool = True) -> None:
        """Partition two hosts from each other alone (both keep their other links): each routes
        the other's address through a neighbour that does not exist, so packets vanish (no error,
        no reset), as between two racks whose path failed. cut=False heals it."""
        for x, y in ((a, b), (b, a)):
            if cut:
                _ip("-n", x.ns, "route", "replace", f"{y.ip}/32", "via", self.void)
            else:
                _ip("-n", x.ns, "route", "del", f"{y.ip}/32", check=False)

    def shape(self, host: Host, bits_per_s: int | None) -> None:
        """Cap what the host sends at `bits_per_s` (a token bucket on its interface: a slow link,
        packets queue rather than drop), or lift the cap (None)."""
        if bits_per_s is None:
            self.run(host, ["tc", "qdisc", "del", "dev", "eth0", "root"])
            return
        # The bucket must hold a timer tick's worth of bytes (4 ms at HZ=250) or a fast cap falls short.
        burst = max(4000, bits_per_s // 2000)  # bytes
        r = self.run(
            host,
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                f"{bits_per_s}bit",
                "burst",
                str(burst),
                "latency",
                "5s",
            ],
        )
        if r.returncode != 0:
            raise ShapingUnavailable(f"tc tbf: {r.stderr.strip() or r.returncode}")

    @staticmethod
    def pause(srv: ServerProcess, stopped: bool) -> None:
        """SIGSTOP (alive, sockets open, silent) or SIGCONT."""
        os.kill(srv.proc.pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _stop_all(self.hosts)
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)  # takes its end of the veth pair, and so both
            _ip("link", "del", host.port_dev, check=False)
        _ip("link", "del", self.bridge, check=False)


def _stop_all(hosts: dict[str, Host]) -> None:
    procs = [srv for host in hosts.values() for srv in host.procs]
    for srv in procs:  # all at once: each drains for up to its shutdown timeout
        for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped process cannot act on SIGTERM
            try:
                os.killpg(srv.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for srv in procs:
        srv.stop(grace=10)


def wait_until(predicate, timeout: float, what: str, period: float = 0.2):
    """Poll `predicate` until it returns something true; AssertionError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


class LoopbackCluster:
    """The same hosts without root: each host is its own loopback address (127.x.y.N, all of
    127.0.0.0/8 reaches this machine), its processes run plainly. There is no link of a host's own
    to take down, cut or slow (link, cut and shape raise ShapingUnavailable), and processes share
    /dev/shm and the hostname: what stays testable is every fault of a process (kill, stop,
    restart), of a peer (Redis) and of the requests."""

    def __init__(self, host_names: list[str], workdir: Path, shm_mb: int = 512) -> None:
        del shm_mb  # one /dev/shm for all
        pid = os.getpid()
        self.gateway = "127.0.0.1"
        self.workdir = workdir
        self.hosts = {
            name: Host(name, "", f"127.{100 + pid % 100}.{pid // 100 % 250 + 1}.{10 + i}", "")
            for i, name in enumerate(host_names)
        }
        self._closed = False
        atexit.register(self.close)

    def wrap(self, host: Host, cmd: list[str]) -> list[str]:
        return cmd  # a loopback host is this machine as it is

    start = Cluster.start

    def run(self, host: Host, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def link(self, host: Host, up: bool) -> None:
        raise ShapingUnavailable("a loopback host has no link of its own (network namespaces need root)")

    def cut(self, a: Host, b: Host, cut: bool = True) -> None:
        raise ShapingUnavailable("loopback hosts share one interface: no path between two can be cut")

    def shape(self, host: Host, bits_per_s: int | None) -> None:
        raise ShapingUnavailable("a loopback host has no link of its own to slow")

    pause = staticmethod(Cluster.pause)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _stop_all(self.hosts)
