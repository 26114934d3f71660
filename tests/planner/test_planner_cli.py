"""`pdserve profile` and `pdserve plan` as a user runs them: bad arguments exit 2 naming the problem,
an infeasible SLO exits 1 saying so, and a profile of a tiny random model feeds a plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.planner.cli import main
from pdserve.planner.step_costs import StepCosts

sys.path.insert(0, str(Path(__file__).parent))
from test_planner_search import synthetic  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLAN = [
    "plan",
    "--workload",
    "fixed",
    "--rate",
    "1",
    "--slo-ttft-ms",
    "2000",
    "--slo-tpot-ms",
    "100",
    "--max-workers",
    "3",
    "--num-requests",
    "20",
]


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    synthetic().save(path)
    return str(path)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--rate", "-1"], "--rate"),
        (["--rate", "x"], "--rate"),
        (["--max-workers", "0"], "--max-workers"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
        (["--decode-max-num-seqs", "8,a"], "--decode-max-num-seqs"),
    ],
)
def test_plan_bad_arguments_exit_2(capsys, profile_file, args, needle):
    opts = dict(zip(PLAN[1::2], PLAN[2::2]))
    opts.update(zip(args[::2], args[1::2]))
    argv = ["plan", "--profile", profile_file] + [x for kv in opts.items() for x in kv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_plan_missing_argument_profile_or_workload_exits_2(capsys, profile_file, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--workload", "fixed", "--rate", "1"])
    assert e.value.code == 2 and "required" in capsys.readouterr().err
    assert main(PLAN + ["--profile", str(tmp_path / "none.json")]) == 2
    assert "pdserve profile" in capsys.readouterr().err
    bad = PLAN + ["--profile", profile_file]
    bad[bad.index("fixed")] = "no-such-workload"
    assert main(bad) == 2 and "unknown workload" in capsys.readouterr().err


def test_plan_prints_the_split_and_settings_or_says_infeasible(capsys, profile_file):
    assert main(PLAN + ["--profile", profile_file]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "TTFT p50" in out and "max_num_seqs" in out and "INFEASIBLE" not in out
    assert main(PLAN + ["--profile", profile_file, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["workers"] <= 3 and best["ttft_ms"]["p50"] > 0
    tight = PLAN + ["--profile", profile_file]
    tight[tight.index("--slo-ttft-ms") + 1] = "1"
    assert main(tight) == 1
    assert "INFEASIBLE" in capsys.readouterr().out


def test_profile_bad_arguments_exit_2():
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "profile", "--prefill-chunks", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2 and "--prefill-chunks" in run.stderr
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "profile",
            "--model",
            "tiny-llama",
            "--transfer-backend",
            "carrier-pigeon",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2 and "transfer" in run.stderr


@pytest.mark.slow
def test_profile_of_a_tiny_model_feeds_a_plan(tmp_path):
    out = tmp_path / "tiny.json"
    # With the served requests: a 1P1D deployment and a mixed server of the tiny model start and answer.
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "profile", "--model", "tiny-llama", "--quick", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    costs = StepCosts.load(out)
    assert costs.model == "tiny-llama" and costs.threads == 1 and costs.quantization == "none"
    assert costs.prefill.rows == [16, 64] and costs.decode.rows == [1, 4] and costs.transport == "shm"
    assert all(s > 0 for row in costs.decode.seconds for s in row) and costs.kv_bytes_per_token > 0
    assert costs.serving is not None and costs.serving.pd_remote_overhead_s >= 0
    # The calibration read the served workers' own step counters and scaled the grids to them.
    assert "less the served steps" in run.stderr, run.stderr[-2000:]
    assert all(costs.notes["served_scale"][k] > 0 for k in ("decode", "prefill"))
    plan = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *PLAN, "--profile", str(out), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert plan.returncode in (0, 1), plan.stderr[-2000:]
    assert json.loads(plan.stdout)["best"]["deployment"]
