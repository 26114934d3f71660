"""The evaluation-harness and vLLM-client benchmarks' pure parts: their local task data, the harness's
environment, and how the scripts read results; nothing here installs lm-eval or vLLM."""

import importlib.util
import json
from pathlib import Path

import yaml

from pdserve.bench import lm_eval

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "benchmarks" / "lm_eval_tasks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tasks_name_files_in_the_repository_and_the_script_runs_them():
    parity = load_script("lm_eval_parity")
    names = set()
    for f in TASKS.glob("*.yaml"):
        cfg = yaml.safe_load(f.read_text())
        names.add(cfg["task"])
        assert cfg["dataset_path"] == "json"
        # Relative to the repository root, where the script runs the harness.
        for path in cfg["dataset_kwargs"]["data_files"].values():
            assert (ROOT / path).is_file(), path
    assert names == {parity.MC, parity.PPL}


def test_multiple_choice_questions_have_four_choices_and_a_valid_answer():
    rows = [json.loads(line) for line in (TASKS / "general_mc.jsonl").read_text().splitlines()]
    assert len(rows) == 80
    assert len({r["question"] for r in rows}) == 80
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4, r
        assert r["answer"] in range(4)
    # No answer position that a model biased to it would be rewarded for.
    assert {sum(r["answer"] == k for r in rows) for k in range(4)} == {20}


def test_rolling_text_is_a_few_thousand_characters_of_prose():
    docs = [json.loads(line) for line in (TASKS / "docs_text.jsonl").read_text().splitlines()]
    total = sum(len(d["text"]) for d in docs)
    assert 5 <= len(docs) and 8_000 < total < 20_000


def test_harness_env_is_offline_with_its_caches_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert lm_eval.cache_dir() == tmp_path / "lm-eval"
    assert lm_eval.installed() is None
    base = {"PATH": "/bin"}
    env = lm_eval.env(base, threads=3)
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["HF_HOME"] == str(tmp_path / "lm-eval" / "home")
    assert env["OMP_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    assert base == {"PATH": "/bin"}


def test_mc_detail_counts_picks_that_differ():
    parity = load_script("lm_eval_parity")

    def run(lls):
        # The harness writes each choice's (loglikelihood, is_greedy) as strings.
        return {
            "samples": {
                parity.MC: [
                    {"doc_id": i, "resps": [[[str(x), "False"]] for x in row]} for i, row in enumerate(lls)
                ]
            }
        }

    hf = run([[-1.0, -2.0, -3.0, -4.0], [-5.0, -1.0, -6.0, -7.0]])
    ours = run([[-1.0, -2.0, -3.0, -4.0], [-0.5, -1.0, -6.0, -7.0]])
    got = parity.mc_detail(hf, ours)
    assert got["questions"] == 2 and got["picks_differ"] == 1
    assert abs(got["max_loglikelihood_diff"] - 4.5) < 1e-9


def test_bench_client_counts_a_run_without_a_result_as_all_failed():
    client = load_script("vllm_bench_client")
    lost = client.summary("chat", {"rc": 1, "log": "x"}, sent=64)
    assert lost["completed"] == 0 and lost["failed"] == 64
    done = client.summary(
        "completions",
        {"rc": 0, "completed": 63, "failed": 1, "errors": ["", "HTTP 400: bad"], "output_throughput": 9.0},
        sent=64,
    )
    assert done["failed"] == 1 and done["first_error"] == "HTTP 400: bad"
