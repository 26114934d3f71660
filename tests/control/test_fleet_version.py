"""A worker the controller adds runs the version most of the fleet runs: after a rollout, the new
config, not the deployment's first one (that would leave the fleet mixed, and the controller
holding for a rollout that has ended). The choice (control/scaling_policy.py fleet_version), then
the local fleet starting real worker processes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.config import load_config
from pdserve.control.local_fleet import LocalFleet
from pdserve.control.scaling_policy import fleet_version
from pdserve.router.registry import Breaker, Worker
from pdserve.version import config_digest
from pdserve.worker_process import write_worker_config

MODEL = "tiny-qwen2"
A, B = "0.1.0+aaaaaaaaaaaa", "0.1.0+bbbbbbbbbbbb"


def test_the_version_most_serving_workers_run():
    assert fleet_version([B, B, B, A]) == B
    assert fleet_version([A, None, A, B]) == A
    # Nothing known, or a tie (a rollout stopped half way): the deployment's config.
    assert fleet_version([]) is None
    assert fleet_version([None, None]) is None
    assert fleet_version([A, B, A, B]) is None


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


@pytest.mark.slow
def test_a_scale_up_after_a_rollout_starts_the_new_version(tmp_path):
    deployment = load_config(overrides={"model.name": MODEL, "router.encoder_workers": 0})
    config_file = write_worker_config(deployment, tmp_path / "deployment.yaml")
    fleet = LocalFleet(deployment, [], config_file, tmp_path, "http://127.0.0.1:1")
    # The rollout's new config, as POST /admin/workers hands it to the fleet.
    path, new = fleet.write_config(
        load_config(overrides={"model.name": MODEL, "scheduler.max_num_seqs": 32}).to_dict()
    )
    old_digest, new_digest = config_digest(load_config(config_file)), config_digest(new)
    assert old_digest != new_digest

    async def go() -> None:
        url = await fleet.start("decode", path, 300)  # the rollout's worker
        h = _health(url)
        assert h["config_digest"] == new_digest
        like = Worker(
            worker_id="decode-new",
            url=url,
            role="decode",
            breaker=Breaker(3, 5.0),
            pdserve_version=h["pdserve_version"],
            config_digest=h["config_digest"],
        )
        await fleet.add("prefill", like)
        added = fleet.workers[-1]
        for _ in range(1200):
            if added.healthy() or added.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert added.healthy(), added.log_path.read_text()[-2000:]
        h = _health(added.url)
        assert (h["config_digest"], h["role"]) == (new_digest, "prefill")
        # Without a worker to copy (none serves, or versions tie): the deployment's config file.
        await fleet.add("decode")
        assert fleet.workers[-1].config_file == config_file

    try:
        asyncio.run(go())
    finally:
        for p in fleet.workers:
            p.stop()
        for p in fleet.workers:
            p.wait(30)
