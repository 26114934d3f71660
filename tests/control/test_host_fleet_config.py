"""controller.backend: hosts needs the agents' URLs (a bad one names controller.agents); the hosts fleet's
errors and its count of added workers still starting."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("agents", "said"),
    [([], "is empty"), (["10.0.0.3:7070"], "'10.0.0.3:7070' is not a URL")],
)
def test_hosts_backend_needs_agent_urls(tmp_path, agents, said):
    p = tmp_path / "c.yaml"
    p.write_text(f"controller: {{backend: hosts, agents: {agents}}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    [(key, problem)] = e.value.problems
    assert key == "controller.agents" and said in problem and "pdserve agent" in problem


def test_hosts_backend_with_agents_loads(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("controller: {backend: hosts, agents: ['http://10.0.0.3:7070']}\n")
    assert load_config(p).controller.agents == ["http://10.0.0.3:7070"]


def test_an_agent_that_does_not_answer_is_a_runtime_error(tmp_path):
    """A transport failure reaches the fleet's callers as RuntimeError, which the rollout API answers
    with 502 and the controller records as a failed action (an unhandled one was a 500)."""
    import asyncio

    import yaml

    from pdserve.bench.procs import free_port
    from pdserve.control.host_fleet import HostsFleet

    agent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = tmp_path / "w.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "tiny-qwen2"}}))
    fleet = HostsFleet(load_config(cfg), [agent], None, tmp_path)

    async def go() -> None:
        try:
            with pytest.raises(RuntimeError, match="ConnectError"):
                await fleet.start("decode", cfg, 5.0)
            with pytest.raises(RuntimeError, match="ConnectError"):
                await fleet.add("prefill")
        finally:
            await fleet.aclose()

    asyncio.run(go())


def test_an_added_worker_that_dies_before_registering_stops_counting_as_starting(tmp_path):
    """The controller holds while a worker it added has not registered (`starting`). One that bound
    its port and then died before registering must stop counting once its agent lists it exited,
    not at the start deadline (minutes of a controller that does nothing). The agent's answers here
    are given; tests/control/test_host_fleet_e2e.py runs the real agent."""
    import asyncio

    import yaml

    from pdserve.control import host_fleet
    from pdserve.control.host_fleet import HostsFleet
    from pdserve.protocol.control import HostWorker

    cfg = tmp_path / "w.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "tiny-qwen2"}}))
    agent = "http://10.0.0.3:7070"
    fleet = HostsFleet(load_config(cfg), [agent], None, tmp_path)
    listed = {"w": HostWorker(id="w1", role="prefill", pid=10, alive=True)}

    async def start_on(a, role, config):
        return listed["w"]

    async def pick(near=None):
        return agent

    async def listing():
        return {agent: [listed["w"]]}

    fleet._start_on, fleet._pick, fleet._listing = start_on, pick, listing

    async def until(cond, what: str) -> None:
        # The fleet polls its agent every POLL_S; a deadline far past that, for a loaded machine.
        deadline = asyncio.get_running_loop().time() + 30
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)

    async def go() -> None:
        host_fleet.POLL_S = 0.01
        await fleet.add("prefill")
        assert fleet.starting(set()) == 1
        listed["w"] = HostWorker(id="w1", role="prefill", pid=10, alive=True, url="http://10.0.0.3:8001")
        await until(lambda: fleet._pending[0].url is not None, "the fleet learns the worker's URL")
        assert fleet.starting(set()) == 1  # bound its port, not registered yet
        listed["w"] = HostWorker(id="w1", role="prefill", pid=10, alive=False, exit_code=1)
        await until(lambda: fleet.starting(set()) == 0, "a worker that died stops counting as starting")
        # One that registers is counted with its pool from then on.
        listed["w"] = HostWorker(id="w2", role="prefill", pid=11, alive=True, url="http://10.0.0.3:8002")
        await fleet.add("prefill")
        assert fleet.starting(set()) == 1
        await until(lambda: fleet._pending[0].url is not None, "the fleet learns the second worker's URL")
        assert fleet.starting({"http://10.0.0.3:8002"}) == 0
        assert fleet.starting(set()) == 0

    poll = host_fleet.POLL_S
    try:
        asyncio.run(go())
    finally:
        host_fleet.POLL_S = poll
