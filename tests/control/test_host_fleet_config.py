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
