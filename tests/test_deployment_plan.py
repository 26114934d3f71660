"""`pdserve serve --dry-run`: the config checked against the model (its architecture read without the
weights) and the deployment plan printed; deployment.pd_ratio counts devices and never silently
overrides the instance counts given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import ConfigError, load_config
from pdserve.deployment_plan import make_plan, pd_counts

ROOT = Path(__file__).resolve().parents[1]
WIDE_EP = ROOT / "examples" / "wide-ep.yaml"
# Qwen3-30B-A3B's shape: 128 experts, enough for the sample's decode EP 64. Only config.json is read.
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--dry-run", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture
def moe_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))  # no weights at all: the dry run needs none
    return tmp_path


def _row(out: str, role: str) -> list[str]:
    return next(ln.split() for ln in out.splitlines() if ln.split()[:1] == [role])


def test_dry_run_of_the_defaults():
    r = dry_run()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "smollm2-135m (llama, 30 layers, dense" in out
    assert "mode: pd, 4 processes" in out  # router + its encoder + 1 prefill + 1 decode
    assert "router 127.0.0.1:8000" in out
    #                role   instances EP processes threads max_num_seqs batched KV
    assert _row(out, "prefill")[:8] == ["prefill", "1", "1", "1", "1", "64", "512", "1"]
    assert _row(out, "decode")[:8] == ["decode", "1", "1", "1", "1", "64", "512", "1"]
    # quantization auto, shown as it resolves for the packaged Q4_1 file, and the KV cache in bfloat16
    # over those int4 weights (cache.kv_dtype auto)
    assert (
        _row(out, "prefill")[8:13]
        == _row(out, "decode")[8:13]
        == ["GB,", "bfloat16", "(auto)", "int4", "(auto)"]
    )
    assert "warning" not in out


def test_dry_run_of_the_wide_ep_sample_needs_a_moe_model():
    r = dry_run("--config", str(WIDE_EP))
    assert r.returncode == 2
    assert "deployment.prefill.expert_parallel: 8: expert parallelism needs a MoE model" in r.stderr
    assert "deployment.decode.expert_parallel: 64: expert parallelism needs a MoE model" in r.stderr
    assert "smollm2-135m" in r.stderr and "dense" in r.stderr and not r.stdout


def test_dry_run_of_the_wide_ep_sample_with_a_moe_model(moe_dir):
    r = dry_run("--config", str(WIDE_EP), "--model", str(moe_dir), "--port", "9000")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "qwen3_moe, 48 layers, MoE, 128 experts top-8 in 48 layers" in out
    assert _row(out, "prefill")[:4] == ["prefill", "4", "8", "32"]
    assert _row(out, "decode")[:4] == ["decode", "1", "64", "64"]
    assert "mode: pd, 98 processes" in out and "router 127.0.0.1:9000" in out
    assert "prefill least_load, decode least_load" in out and "bandwidth limit 80%" in out
    [warning] = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert "pd_ratio '1:1'" in warning and "32:64" in warning and "instance counts are used" in warning


def test_a_moe_model_with_fewer_experts_than_ranks_is_refused():
    with pytest.raises(ConfigError) as e:
        make_plan(load_config(WIDE_EP, {"model.name": "tiny-mixtral"}))  # 16 experts, decode EP 64
    assert [k for k, _ in e.value.problems] == ["deployment.decode.expert_parallel"]
    with pytest.raises(ConfigError, match="model.name"):
        make_plan(load_config(None, {"model.name": "no-such-model"}))
    # Per-role quantization (prefill in float32, decode in int4), MoE models too.
    plan = make_plan(
        load_config(None, {"model.quantization": "none", "deployment.decode.quantization": "int4"})
    )
    assert [rp.config.model.quantization for rp in plan.roles] == ["none", "int4"]
    # One KV dtype for both ends of a transfer: the decode role's (int4 weights: bfloat16).
    assert [rp.config.cache.kv_dtype for rp in plan.roles] == ["bfloat16", "bfloat16"]
    plan = make_plan(
        load_config(None, {"model.quantization": "int4", "deployment.decode.quantization": "none"})
    )
    assert [rp.config.cache.kv_dtype for rp in plan.roles] == ["float32", "float32"]
    # The default, auto, is planned as it resolves: the packaged file stores Q4_1, a tiny model is float.
    assert [rp.config.model.quantization for rp in make_plan(load_config()).roles] == ["int4", "int4"]
    tiny = make_plan(
        load_config(None, {"model.name": "tiny-llama", "deployment.decode.quantization": "int8"})
    )
    assert [rp.config.model.quantization for rp in tiny.roles] == ["none", "int8"]
    moe = make_plan(
        load_config(None, {"model.name": "tiny-mixtral", "deployment.decode.quantization": "int8"})
    )
    assert [rp.config.model.quantization for rp in moe.roles] == ["none", "int8"]  # experts too


def counts(**overrides):
    return pd_counts(
        load_config(None, {f"deployment.{k.replace('__', '.')}": v for k, v in overrides.items()})
    )


def test_pd_ratio_counts_devices_and_given_instances_win():
    assert counts() == (1, 1, [])
    assert counts(pd_ratio="1:3") == (1, 3, [])
    assert counts(pd_ratio="2:4") == (2, 4, [])  # the numbers as written
    # devices: 8 prefill instances of EP 8 match one decode instance of EP 64 at 1:1
    assert counts(pd_ratio="1:1", prefill__expert_parallel=8, decode__expert_parallel=64) == (8, 1, [])
    # one count given: the other follows the ratio (rounded up to whole instances)
    assert counts(pd_ratio="1:2", prefill__instances=3)[:2] == (3, 6)
    # both given and off the ratio: they win, with a warning
    p, d, warnings = counts(
        pd_ratio="1:1",
        prefill__instances=4,
        prefill__expert_parallel=8,
        decode__instances=1,
        decode__expert_parallel=64,
    )
    assert (p, d) == (4, 1) and len(warnings) == 1 and "32:64" in warnings[0]
    assert counts(pd_ratio="1:2", prefill__instances=1, decode__instances=2) == (1, 2, [])


def test_serve_logs_the_ratio_warning_at_start_up(moe_dir, tmp_path):
    """The warning reaches the start-up log too: a real `pdserve serve`, whose workers then fail on the
    weightless model directory, so nothing heavy runs."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f'model:\n  name: {moe_dir}\ndeployment:\n  pd_ratio: "1:2"\n'
        "  prefill:\n    instances: 1\n  decode:\n    instances: 1\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode != 0 and "safetensors" in r.stderr  # the workers found no weights
    [warning] = [ln for ln in r.stderr.splitlines() if "WARNING" in ln]
    assert "pd_ratio '1:2'" in warning and "1:1" in warning and "instance counts are used" in warning


def test_describe_names_the_loaders_default_model():
    from pdserve.model import describe, loader

    assert describe.DEFAULT_MODEL == loader.DEFAULT_MODEL
    assert describe.default_gguf_path() == loader.default_gguf_path()
    assert (
        describe.describe_model("tiny-qwen2-moe").num_experts
        == loader.load_model_files("tiny-qwen2-moe").arch.num_experts
    )


def test_dry_run_describes_an_mla_model():
    r = dry_run("--model", "tiny-deepseek-v3")
    assert r.returncode == 0, r.stderr
    assert "MoE, 16 experts top-2 in 2 layers, MLA (KV: latent 32 + rope 8 per token)" in r.stdout
