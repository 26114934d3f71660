"""controller.backend: hosts needs the agents' URLs; a bad one names controller.agents."""

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
