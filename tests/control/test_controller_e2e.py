"""The controller in a real deployment (`pdserve serve`: router + worker processes, controller.backend
local) while four clients stream:
- scale-down: with the fleet far under its SLOs it removes a worker down to min_workers, emptying
  it first: no request fails, outputs equal the offline engine's, the process is gone;
- scale-up: with every request over the SLOs it starts a worker up to max_workers, which registers
  itself and takes requests;
- a switch to decode evens the pool out: the streams piled on the one decode worker move over to
  the worker that joined, mid-generation, and their outputs do not change.
Every decision is at GET /admin/controller (newest last, with time, action, worker, reason) and
the actions are counted in /metrics."""

from __future__ import annotations

import os

import httpx
import pytest
import yaml
from load_client import (
    ADMIN,
    MODEL,
    Load,
    admin,
    counter_sum,
    offline_outputs,
    pool_at_start,
    prompt,
    wait_for,
    workers,
)

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow
FRESH = [prompt(i) for i in range(100, 108)]
# Replies long enough that a decode worker's requests are mostly generating (on a fast CPU 256 tokens
# of the tiny model took a third of a second: a switch could find the streams between two replies).
LONG = 768


def _deployment(
    tmp_path, name: str, prefill: int, decode: int, controller: dict, deployment: dict | None = None
) -> ServerProcess:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "deployment": deployment or {},
                "router": {"admin_keys": [ADMIN], "health_period_s": 0.2},
                "controller": {
                    "enabled": True,
                    "interval_s": 0.5,
                    "sustain_intervals": 2,
                    "cooldown_s": 3.0,
                    "drain_timeout_s": 0.2,
                    "min_workers": 2,
                    "max_workers": 3,
                    **controller,
                },
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
    return ServerProcess(cmd, port, tmp_path / f"{name}.log")


def _actions(url: str) -> list[dict]:
    return [d for d in admin(url, "GET", "/admin/controller").json() if d["action"] != "hold"]


def test_scale_down_empties_the_worker_first(tmp_path):
    want = offline_outputs()
    # SLOs no request comes near: both pools stay cold, so the controller sheds a worker.
    with _deployment(tmp_path, "down", 1, 2, {"slo_ttft_ms": 1e7, "slo_tpot_ms": 1e7}) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        before = workers(url)
        load = Load(url)
        try:
            [removed] = wait_for(lambda: _actions(url), "no scale-down", timeout=120)
            load.progress(8, "no progress after the scale-down")
        finally:
            load.finish()
        assert removed["action"] == "remove_decode" and removed["ok"], removed
        assert {"time", "action", "worker", "reason", "inputs"} <= set(removed)
        gone = before[removed["worker"]]
        assert removed["worker"] not in workers(url)
        wait_for(
            lambda: not os.path.exists(f"/proc/{gone['pid']}") or _zombie(gone["pid"]), "worker still running"
        )
        assert load.errors == []
        assert load.wrong(want) == []
        for w in workers(url).values():
            pool_at_start(w["url"])
        # At min_workers: it holds from now on, whatever the figures say.
        assert len(workers(url)) == 2 and len(_actions(url)) == 1
        # The reading after the removal may not have come yet (interval 0.5 s): wait for it.
        last = wait_for(
            lambda: [d for d in admin(url, "GET", "/admin/controller").json() if d["time"] > removed["time"]],
            "no reading after the scale-down",
            timeout=30,
        )
        assert {d["action"] for d in last} == {"hold"}
        metrics = httpx.get(url + "/metrics").text
        assert 'pdserve_controller_actions_total{action="remove_decode",outcome="ok"} 1.0' in metrics


def test_scale_up_starts_a_worker_that_takes_requests(tmp_path):
    want, want_fresh = offline_outputs(), offline_outputs(FRESH)
    # SLOs every request misses: both pools hot, below max_workers, so the controller adds one (this
    # test is about adding: at max_workers it moves none, and min_workers keeps the idle end from
    # removing one).
    with _deployment(
        tmp_path,
        "up",
        1,
        1,
        {"slo_ttft_ms": 0.001, "slo_tpot_ms": 0.001, "switch_gain": 1e9, "min_workers": 3},
    ) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        load = Load(url)
        try:
            [added] = wait_for(lambda: _actions(url), "no scale-up", timeout=120)
            assert added["action"] in ("add_prefill", "add_decode") and added["ok"], added
            role = added["action"].split("_")[1]
            new = wait_for(
                lambda: [w for w in workers(url).values() if w["healthy"] and w["id"].startswith(role + "@")],
                "the new worker never registered",
                timeout=180,
            )
            # Fresh prompts, cached nowhere: the idle new worker is the cheapest place for them.
            fresh = Load(url, threads=4, prompts=FRESH)
            try:
                fresh.progress(4, "no progress after the scale-up")
            finally:
                fresh.finish()
            assert workers(url)[new[0]["id"]]["requests"] > 0, "the new worker took no request"
        finally:
            load.finish()
        assert load.errors == [] and fresh.errors == []
        assert load.wrong(want) == [] and fresh.wrong(want_fresh) == []
        assert len(workers(url)) == 3 and len(_actions(url)) == 1  # at max_workers: holds
        for w in workers(url).values():
            pool_at_start(w["url"])


def test_switch_to_decode_moves_streams_onto_the_new_decode_worker(tmp_path):
    want = offline_outputs(max_tokens=LONG)
    # Decode over its SLO, prefill far under it, the fleet at its size: one prefill worker switches
    # to decode, once (the cooldown outlasts the test). Its workers keep their own cores, as workers
    # on several hosts do: where idle prefill workers lend theirs to decode steps, none is switched
    # for a decode gap (tests/control/test_scaling_policy.py).
    with _deployment(
        tmp_path,
        "even",
        2,
        1,
        {"slo_ttft_ms": 1e7, "slo_tpot_ms": 0.001, "min_workers": 3, "max_workers": 3, "cooldown_s": 1000.0},
        {"share_idle_cores": False},
    ) as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        [d1] = [i for i, w in workers(url).items() if w["role"] == "decode"]
        load = Load(url, threads=8, max_tokens=LONG)  # eight streams on the one decode worker
        try:
            # The controller needs `sustain_intervals` hot readings (a second) before it switches: by
            # then the eight streams are generating on d1.
            acts = wait_for(
                lambda: [a for a in _actions(url) if a["action"] == "rebalance"] and _actions(url),
                lambda: f"no rebalance after the switch: {_actions(url)}",
                timeout=120,
            )
            load.progress(8, "no progress after the rebalance")
        finally:
            load.finish()
        switch, rebalance = acts[0], acts[1]
        assert switch["action"] == "switch_to_decode" and switch["ok"], switch
        joined = switch["worker"]
        assert rebalance["worker"] == d1 and rebalance["ok"] and rebalance["inputs"]["moved"] >= 1, rebalance
        assert load.errors == []
        assert load.wrong(want) == [], "a moved stream's output differs from the offline engine's"
        assert workers(url)[joined]["requests"] > 0
        moved = counter_sum(httpx.get(url + "/metrics").text, "pdserve_router_worker_moved_total")
        assert moved >= rebalance["inputs"]["moved"]
        assert (
            'pdserve_controller_actions_total{action="rebalance",outcome="ok"} 1.0'
            in httpx.get(url + "/metrics").text
        )
        for w in workers(url).values():
            pool_at_start(w["url"])


def _zombie(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"
