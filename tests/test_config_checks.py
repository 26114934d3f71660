"""Config values are checked at load: a bad value, key or type stops `pdserve` with exit status 2
and a message naming the key, the value and what is allowed; the wide-EP sample's aliases load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import ConfigError, apply_role, for_role, load_config
from pdserve.config_rules import BOUNDS, CHOICES, FORMATS, POLICIES

ROOT = Path(__file__).resolve().parents[1]

# The four values a review saw accepted silently, and what the message must name.
BAD = [
    ("transfer:\n  backend: tpc\n", "transfer.backend", "'tpc'", "tcp"),
    ("deployment:\n  mode: pdd\n", "deployment.mode", "'pdd'", "mixed"),
    ("model:\n  dtype: fp8\n", "model.dtype", "'fp8'", "bfloat16"),
    ("load_balancer:\n  decode: costt\n", "load_balancer.decode", "'costt'", "least_load"),
]


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.mark.parametrize("text,key,value,allowed", BAD)
def test_bad_values_raise_naming_key_value_and_allowed(tmp_path, text, key, value, allowed):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    [(k, msg)] = e.value.problems
    assert k == key and value in msg and allowed in msg


def test_cli_exits_2_naming_each_bad_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("".join(t for t, *_ in BAD))
    r = pdserve("serve", "--config", str(f), "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    for _, key, value, allowed in BAD:
        line = next(ln for ln in r.stderr.splitlines() if key in ln)
        assert value in line and allowed in line
    assert "Traceback" not in r.stderr


def test_a_bad_quantization_exits_2_naming_model_quantization(tmp_path):
    f = tmp_path / "q.yaml"
    f.write_text("model:\n  quantization: q4_1\n")
    r = pdserve("serve", "--config", str(f), "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "model.quantization" in ln)
    assert "'q4_1'" in line and "auto" in line and "int4" in line
    r = pdserve("serve", "--quantization", "q4_1", "--dry-run")  # argparse's choices, from config_rules
    assert r.returncode == 2 and "'q4_1'" in r.stderr and "auto" in r.stderr


def test_cli_exits_2_on_a_bad_worker_flag_and_names_it():
    # The real worker command: it must stop at the config, before loading any model.
    r = pdserve("worker", "--role", "decode", "--threads", "0", "--max-num-seqs", "-1")
    assert r.returncode == 2
    assert "server.threads (a command-line flag): 0" in r.stderr and "at least 1" in r.stderr
    assert "scheduler.max_num_seqs (a command-line flag): -1" in r.stderr
    r = pdserve("serve", "--dtype", "fp8", "--dry-run")  # argparse's choices, from config_rules
    assert r.returncode == 2 and "'fp8'" in r.stderr and "float16" in r.stderr


@pytest.mark.parametrize(
    "overrides,key,needle",
    [
        ({"server.threads": "two"}, "server.threads", "an integer"),
        ({"cache.block_size": True}, "cache.block_size", "an integer"),
        ({"cache.device_memory_gb": 0}, "cache.device_memory_gb", "above 0"),
        ({"server.port": 70000}, "server.port", "65535"),
        ({"deployment.pd_ratio": 61}, "deployment.pd_ratio", "quoted"),  # YAML's reading of an unquoted 1:1
        ({"deployment.pd_ratio": "1:0"}, "deployment.pd_ratio", "P:D"),
        ({"deployment.decode.instances": 0}, "deployment.decode.instances", "at least 1"),
        ({"deployment.prefill.quantization": "int3"}, "deployment.prefill.quantization", "int4"),
        ({"transfer.bandwidth_limit": "180%"}, "transfer.bandwidth_limit", "50%"),
        ({"router.ip_allowlist": ["10.0.0.0/33"]}, "router.ip_allowlist", "CIDR"),
        ({"router.workers": [{"url": "http://a:1", "role": "decoder"}]}, "router.workers", "prefill"),
        ({"cache.remote": "redis:/x"}, "cache.remote", "redis://"),
        ({"model.device": "gpu"}, "model.device", "cuda"),
        ({"disagg.transfer_timeout_s": 0}, "disagg.transfer_timeout_s", "above 0"),
        (
            {"disagg.local_prefill_max_tokens": -1},
            "disagg.local_prefill_max_tokens",
            "at least 0",
        ),  # the default rule
        ({"disagg.parallel_prefill_min_tokens": -1}, "disagg.parallel_prefill_min_tokens", "at least 0"),
        (
            {"disagg.parallel_prefill_attention_weight": -0.5},
            "disagg.parallel_prefill_attention_weight",
            "at least 0",
        ),
        ({"router.tls_cert": "c.pem"}, "router.tls_key", "both or neither"),
        ({"cache.blok_size": 4}, "cache.blok_size", "block_size"),
        ({"load_balancer.strategy": "fastest"}, "load_balancer.strategy", "least_load"),  # the name written
        ({"deployment.load_balancer.strategy": "fastest"}, "deployment.load_balancer.strategy", "least_load"),
        ({"load_balancer.prefill": "fastest"}, "load_balancer.prefill", "least_load"),
        ({"scheduler.speculative_method": "eagle"}, "scheduler.speculative_method", "ngram"),
        ({"scheduler.num_speculative_tokens": 0}, "scheduler.num_speculative_tokens", "from 1 to 16"),
        ({"model.ep_rendezvous": "0.0.0.0:29500"}, "model.ep_rendezvous", "host:port"),
        ({"model.ep_rendezvous": "10.0.0.2"}, "model.ep_rendezvous", "host:port"),
        ({"model.ep_timeout_s": 0}, "model.ep_timeout_s", "above 0"),
        (
            {"deployment.decode.expert_parallel": 4, "model.ep_local_ranks": 2},
            "model.ep_rendezvous",
            "host:port of rank 0",
        ),
        (
            {"model.expert_parallel": 2, "model.ep_local_ranks": 1},
            "model.ep_rendezvous",
            "host:port of rank 0",
        ),
        (
            {
                "model.expert_parallel": 2,
                "model.ep_local_ranks": 1,
                "model.ep_rendezvous": "10.0.0.2:29500",
                "model.ep_attention": "replicated",
            },
            "model.ep_attention",
            "one host",
        ),
        (
            {"model.ep_overlap": True, "model.ep_attention": "replicated"},
            "model.ep_overlap",
            "needs model.ep_attention: data",
        ),
        ({"model.ep_overlap": "yes"}, "model.ep_overlap", "true or false"),
        ({"model.ep_dispatch_dtype": "fp8"}, "model.ep_dispatch_dtype", "bfloat16"),
        (
            {"scheduler.prompt_lookup_min": 5, "scheduler.prompt_lookup_max": 3},
            "scheduler.prompt_lookup_min",
            "at most scheduler.prompt_lookup_max",
        ),
    ],
)
def test_types_ranges_and_formats(overrides, key, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert any(k == key and needle in msg for k, msg in e.value.problems), e.value.problems


def test_every_problem_is_reported_at_once(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  dtype: fp8\n  seed: -3\nscheduler:\n  max_num_seqs: 0\nnope: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert [k for k, _ in e.value.problems] == ["nope"]  # unknown keys first: the rest may be misplaced
    f.write_text("model:\n  dtype: fp8\n  seed: -3\nscheduler:\n  max_num_seqs: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert {k for k, _ in e.value.problems} == {"model.dtype", "model.seed", "scheduler.max_num_seqs"}


def test_yaml_errors_name_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        load_config(f)
    r = pdserve("serve", "--config", str(tmp_path / "missing.yaml"), "--dry-run")
    assert r.returncode == 2 and "missing.yaml" in r.stderr


def test_the_wide_ep_sample_loads_with_its_aliases():
    cfg = load_config(ROOT / "examples" / "wide-ep.yaml")
    d = cfg.deployment
    assert d.pd_ratio == "1:1"
    assert (d.prefill.instances, d.prefill.expert_parallel, d.decode.instances, d.decode.expert_parallel) == (
        4,
        8,
        1,
        64,
    )
    assert cfg.cache.prefix_cache is True and cfg.transfer.bandwidth_limit == "80%"
    assert cfg.load_balancer.prefill == cfg.load_balancer.decode == "least_load"
    # the top-level spellings of the same keys, and the loaded config round-trips (workers reload it)
    top = load_config(
        None, {"cache.transfer_bandwidth_limit": "50%", "load_balancer.strategy": "round_robin"}
    )
    assert top.transfer.bandwidth_limit == "50%" and top.load_balancer.decode == "round_robin"


def test_two_spellings_that_disagree_are_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("deployment:\n  cache:\n    prefix_cache: false\ncache:\n  prefix_cache: true\n")
    with pytest.raises(ConfigError, match="conflicts with"):
        load_config(f)
    f.write_text("deployment:\n  cache:\n    prefix_cach: false\n")
    with pytest.raises(ConfigError, match="prefix_cache, transfer_bandwidth_limit"):
        load_config(f)


def test_role_settings_replace_the_global_keys_for_that_role(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "scheduler:\n  max_num_seqs: 64\ncache:\n  device_blocks: 500\nserver:\n  threads: 2\n"
        "model:\n  quantization: none\n"
        "deployment:\n  decode:\n    max_num_seqs: 8\n    max_num_batched_tokens: 128\n"
        "    device_memory_gb: 0.5\n    quantization: int8\n    expert_parallel: 4\n    threads: 1\n"
    )
    base = load_config(f)
    dec, pre = for_role(base, "decode"), for_role(base, "prefill")
    assert (dec.scheduler.max_num_seqs, dec.scheduler.max_num_batched_tokens, dec.model.expert_parallel) == (
        8,
        128,
        4,
    )
    assert dec.model.quantization == "int8" and dec.server.threads == 1
    assert (
        dec.cache.device_memory_gb == 0.5 and dec.cache.device_blocks is None
    )  # the role's budget, not 500 blocks
    assert (
        pre.scheduler.max_num_seqs,
        pre.cache.device_blocks,
        pre.model.quantization,
        pre.server.threads,
    ) == (64, 500, "none", 2)
    assert base.scheduler.max_num_seqs == 64  # for_role copies
    # what `pdserve worker --role decode --config c.yaml [flags]` runs with: the role's settings, its own flags win
    from pdserve.cli import _overrides, build_parser

    args = build_parser().parse_args(
        ["worker", "--role", "decode", "--config", str(f), "--max-num-seqs", "3"]
    )
    w = load_config(args.config, _overrides(args), role=args.role)
    assert (w.scheduler.max_num_seqs, w.model.expert_parallel, w.model.quantization) == (3, 4, "int8")
    assert load_config(None, role="prefill").server.threads == 1  # PD workers: 1 thread unless set
    assert apply_role(load_config(None), "mixed").server.threads is None  # no deployment entry: untouched


def test_rules_name_real_keys_and_the_routers_policies():
    from pdserve.router.policies import POLICIES as ROUTER_POLICIES

    assert set(POLICIES) == set(ROUTER_POLICIES)
    cfg = load_config(None)
    for key in [*CHOICES, *BOUNDS, *FORMATS]:
        obj = cfg
        for part in key.split("."):
            assert hasattr(obj, part), key
            obj = getattr(obj, part)


def test_shipped_configs_load():
    for f in (ROOT / "examples").glob("*.yaml"):
        load_config(f)
