"""`pdserve rollout` against a real deployment (`pdserve serve`: router + worker processes) while
four clients stream greedy completions through the official openai client:
- a rollout that completes: every worker is replaced by one of the new config (started by the
  router's local fleet, canary first, checked, the old one drained and stopped), a worker of the
  old version that joins while it runs too; no request fails, every output equals the offline
  engine's, GET /admin/workers shows only the new version;
- a rollout that rolls back: the second new worker's SLO check fails (a TTFT SLO nobody meets,
  the injected breach), so every replaced worker gets its old version back (the first one's old
  process is gone by then: the fleet starts the old config again) and the new ones leave; no
  request fails and only the old version is left;
- a new worker killed in its window (the failed health check): its streams move, it is retired.
All run the real CLI process, talking to the router's admin API."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import httpx
import pytest
import yaml
from load_client import ADMIN, MODEL, Load, admin, offline_outputs, pool_at_start, wait_for, workers

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config
from pdserve.version import config_digest, version_label

pytestmark = pytest.mark.slow


def _deployment(tmp_path, prefill: int, decode: int) -> ServerProcess:
    cfg = tmp_path / "old.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "router": {"admin_keys": [ADMIN], "health_period_s": 0.2},
                "controller": {"drain_timeout_s": 1.0},
            }
        )
    )
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        MODEL,
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        "--port",
        str(port),
        "--config",
        str(cfg),
    ]
    return ServerProcess(cmd, port, tmp_path / "serve.log")


def _new_config(tmp_path) -> tuple[str, str]:
    """A config that differs from the deployment's in a setting that leaves greedy outputs alone."""
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"model": {"name": MODEL}, "scheduler": {"max_num_seqs": 32}}))
    return str(new), version_label(config_digest(load_config(new))) or ""


def _rollout(url: str, config: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        pdserve_cmd() + ["rollout", "--config", config, "--router", url, "--admin-key", ADMIN, *flags],
        capture_output=True,
        text=True,
        timeout=400,
    )


def _rollout_under_load(
    url: str, config: str, after: str, *flags: str
) -> tuple[Load, subprocess.CompletedProcess]:
    """A rollout run while streams flow, which must progress before it and after it ends (`after`)."""
    load = Load(url)
    try:
        load.progress(4, "no progress before the rollout")
        out = _rollout(url, config, *flags)
        load.progress(4, f"no progress after the {after}")
    finally:
        load.finish()
    print(out.stdout)
    return load, out


def _gone(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _rollout_with_a_joiner(url: str, config: str, joiner: dict, *flags: str) -> tuple[str, dict, int]:
    """Run the rollout CLI; once it starts its last replacement, pause it while a worker of the old
    version joins (as the controller's scale-up or a restarted worker would), then let it go on.
    Returns its output, the joiner and the exit code."""
    cmd = pdserve_cmd() + ["rollout", "--config", config, "--router", url, "--admin-key", ADMIN, *flags]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    joined: dict = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not joined and "[2/2] replacing" in line:
                # Paused, the rollout cannot look at the fleet again before the joiner registered.
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    r = admin(url, "POST", "/admin/workers", json=joiner)
                    assert r.status_code == 201, r.text
                    joined = r.json()
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(lines), joined, rc


def test_a_rollout_under_load_replaces_every_worker(tmp_path):
    """... and a worker of the old version that joins while it runs."""
    want = offline_outputs()
    new_cfg, new_version = _new_config(tmp_path)
    with _deployment(tmp_path, 1, 1) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        before = workers(url)
        old_versions = {w["version"] for w in before.values()}
        assert len(old_versions) == 1 and None not in old_versions and new_version not in old_versions
        # The deployment's own config (the router's and controller's sections are not in the version).
        joiner = {"role": "decode", "config": {"model": {"name": MODEL}}, "timeout_s": 300}
        load = Load(url)
        try:
            load.progress(4, "no progress before the rollout")
            stdout, joined, rc = _rollout_with_a_joiner(
                url,
                new_cfg,
                joiner,
                "--window-s",
                "1.5",
                "--canary-weight",
                "0.5",
                "--slo-ttft-ms",
                "60000",
                "--slo-tpot-ms",
                "60000",
                "--max-error-rate",
                "0.2",
            )
            load.progress(4, "no progress after the rollout")
        finally:
            load.finish()
        print(stdout)
        assert rc == 0, stdout
        assert joined["version"] in old_versions, joined
        assert "rollout complete" in stdout and "1 worker(s) of another version joined meanwhile" in stdout
        assert f"[3/3] replacing {joined['id']}" in stdout, stdout
        # The canary: at weight 0.5, with the old decode worker still serving, the new one took requests.
        first = re.search(r"within the SLOs over (\d+) requests", stdout)
        assert first and int(first[1]) > 0, stdout
        assert load.errors == []
        assert load.wrong(want) == []
        after = workers(url)
        assert sorted(w["role"] for w in after.values()) == ["decode", "decode", "prefill"]
        assert {w["version"] for w in after.values()} == {new_version}
        assert not set(after) & (set(before) | {joined["id"]})
        for w in [*before.values(), joined]:
            assert _gone(w["pid"]), f"{w['id']} still runs"
        assert admin(url, "GET", "/admin/canary").json() == {"version": None, "weight": None}
        metrics = httpx.get(url + "/metrics").text
        assert f'pdserve_router_version_requests_total{{version="{new_version}"}}' in metrics
        for w in after.values():
            assert pool_at_start(w["url"])["config_digest"] == new_version.split("+")[1]


def test_a_rollout_rolls_back_on_an_slo_breach(tmp_path):
    want = offline_outputs()
    new_cfg, new_version = _new_config(tmp_path)
    with _deployment(tmp_path, 0, 2) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        before = workers(url)
        [old_version] = {w["version"] for w in before.values()}
        # Canary weight 0: the first new worker takes nothing (no request, nothing to judge: it
        # passes and its old worker leaves); the second is judged at weight 0.5 against a TTFT
        # SLO of a microsecond.
        load, out = _rollout_under_load(
            url,
            new_cfg,
            "rollback",
            "--window-s",
            "3",
            "--canary-weight",
            "0",
            "--slo-ttft-ms",
            "0.001",
            "--slo-tpot-ms",
            "60000",
            "--max-error-rate",
            "1",
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert "no request reached the new version" in out.stdout, out.stdout
        assert "SLO breach: TTFT p90" in out.stdout and "rolled back" in out.stdout, out.stdout
        assert load.errors == []
        assert load.wrong(want) == []
        after = workers(url)
        assert len(after) == 2 and {w["role"] for w in after.values()} == {"decode"}
        assert {w["version"] for w in after.values()} == {old_version}
        assert len(set(after) & set(before)) == 1  # one old worker stayed, the other was started again
        assert admin(url, "GET", "/admin/canary").json() == {"version": None, "weight": None}
        metrics = httpx.get(url + "/metrics").text
        assert f'pdserve_router_version_requests_total{{version="{new_version}"}}' in metrics
        for w in after.values():
            pool_at_start(w["url"])
        for pid in _worker_pids(srv.proc.pid):
            assert pid in {w["pid"] for w in after.values()}, "a new-version worker still runs"


def test_a_new_worker_that_dies_in_its_window_is_rolled_back(tmp_path):
    """The failed health check: the new decode worker takes every new request (canary weight 1)
    and is killed in its window; its streams move to the old worker, the rollout stops, the dead
    worker is retired, the old one was never touched."""
    want = offline_outputs()
    new_cfg, new_version = _new_config(tmp_path)
    with _deployment(tmp_path, 0, 1) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        before = workers(url)
        load = Load(url)
        killed: list[int] = []

        def kill_the_new_worker() -> None:
            new = wait_for(
                lambda: [
                    w
                    for w in workers(url).values()
                    if w["version"] == new_version and w["healthy"] and w["load"]["in_flight"] > 0
                ],
                "the new worker took no stream",
                timeout=300,
            )
            os.kill(new[0]["pid"], signal.SIGKILL)
            killed.append(new[0]["pid"])

        killer = threading.Thread(target=kill_the_new_worker, daemon=True)
        try:
            load.progress(2, "no progress before the rollout")
            killer.start()
            out = _rollout(
                url,
                new_cfg,
                "--window-s",
                "20",
                "--canary-weight",
                "1",
                "--slo-ttft-ms",
                "60000",
                "--slo-tpot-ms",
                "60000",
                "--max-error-rate",
                "1",
            )
            killer.join(timeout=10)
            load.progress(4, "no progress after the rollback")
        finally:
            load.finish()
        print(out.stdout)
        assert killed, "the new worker was never killed"
        assert out.returncode == 1, out.stdout + out.stderr
        assert "is unhealthy" in out.stdout and "rolled back: health check" in out.stdout, out.stdout
        assert load.errors == []
        assert load.wrong(want) == []
        after = workers(url)
        assert list(after) == list(before) and {w["version"] for w in after.values()} == {
            before[next(iter(before))]["version"]
        }
        assert admin(url, "GET", "/admin/canary").json() == {"version": None, "weight": None}
        pool_at_start(next(iter(after.values()))["url"])


def _worker_pids(parent: int) -> set[int]:
    """Live worker processes of the deployment (children of `pdserve serve` running `pdserve.cli worker`)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
            cmd = open(f"/proc/{name}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] not in "ZX" and b"worker" in cmd:
            out.add(int(name))
    return out
