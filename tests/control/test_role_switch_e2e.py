"""Role switches under streaming load, real processes: a router, one prefill and two decode workers
(`pdserve serve`), four client threads streaming greedy completions through the official openai
client. While they run, workers switch role through `POST /admin/workers/{id}/role`: one with no
time to drain (its in-flight streams move to another decode worker mid-generation), one that drains.
No request fails, every output equals the offline engine's, `/admin/workers` shows the new roles,
and every worker's KV pool is back to its start."""

from __future__ import annotations

import httpx
import pytest
import yaml
from load_client import (
    ADMIN,
    MODEL,
    Load,
    admin,
    counter_sum,
    decoding,
    offline_outputs,
    pool_at_start,
    wait_for,
    workers,
)

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow
# Replies long enough that a switch finds streams generating (48 tokens of the tiny model took a
# twentieth of a second on a fast CPU: the worker mostly held requests waiting for their prefill).
LONG = 768


def test_role_switches_under_streaming_load(tmp_path):
    want = offline_outputs(max_tokens=LONG)
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(yaml.safe_dump({"router": {"admin_keys": [ADMIN], "health_period_s": 0.2}}))
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        MODEL,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--port",
        str(port),
        "--config",
        str(cfg),
    ]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=300)
        url = srv.url
        ws = workers(url)
        [p1] = [i for i, w in ws.items() if w["role"] == "prefill"]
        d1, d2 = sorted(i for i, w in ws.items() if w["role"] == "decode")
        urls = {i: w["url"] for i, w in ws.items()}

        # The admin API: a key, a known role, a known worker.
        assert httpx.post(url + f"/admin/workers/{d1}/role", json={"role": "prefill"}).status_code == 401
        r = admin(url, "POST", f"/admin/workers/{d1}/role", json={"role": "encoder"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert admin(url, "POST", "/admin/workers/nobody/role", json={"role": "decode"}).status_code == 404

        load = Load(url, max_tokens=LONG)
        try:
            # 1. d1 -> prefill with no time to drain: its streams in flight move to d2 mid-generation.
            wait_for(lambda: decoding(urls[d1]) > 0, "no stream generating on d1")
            r = admin(
                url, "POST", f"/admin/workers/{d1}/role", json={"role": "prefill", "drain_timeout_s": 0}
            )
            assert r.status_code == 200, r.text
            assert r.json()["role"] == "prefill"
            # d2 is the last decode worker now: it may not switch away.
            r = admin(url, "POST", f"/admin/workers/{d2}/role", json={"role": "prefill"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "last_decode"
            load.progress(4, "no progress with one decode worker")
            # 2. p1 -> decode, drained (its prefill jobs finish), then d2 -> prefill: the pools swap.
            r = admin(url, "POST", f"/admin/workers/{p1}/role", json={"role": "decode"})
            assert r.status_code == 200 and r.json()["role"] == "decode", r.text
            wait_for(lambda: decoding(urls[d2]) > 0, "no stream generating on d2")
            r = admin(
                url, "POST", f"/admin/workers/{d2}/role", json={"role": "prefill", "drain_timeout_s": 0}
            )
            assert r.status_code == 200 and r.json()["role"] == "prefill", r.text
            load.progress(4, "no progress after the swap")
            # 3. d1 back to decode.
            r = admin(url, "POST", f"/admin/workers/{d1}/role", json={"role": "decode"})
            assert r.status_code == 200 and r.json()["role"] == "decode", r.text
            load.progress(4, "no progress after switching back")
        finally:
            load.finish()

        assert load.errors == []
        assert len(load.done) >= 12
        wrong = load.wrong(want)
        assert wrong == [], f"{len(wrong)} of {len(load.done)} outputs differ from the offline engine's"
        roles = {i: w["role"] for i, w in workers(url).items()}
        assert roles == {p1: "decode", d1: "decode", d2: "prefill"}
        for i, u in urls.items():
            h = pool_at_start(u)
            assert h["role"] == roles[i]
        moved = counter_sum(httpx.get(url + "/metrics").text, "pdserve_router_worker_moved_total")
        assert moved >= 1, "no stream was moved off a switching worker"
        # The switched workers took work in their new roles.
        after = workers(url)
        assert after[d2]["requests"] > ws[d2]["requests"] and after[p1]["requests"] > ws[p1]["requests"]
