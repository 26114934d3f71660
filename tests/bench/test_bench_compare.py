"""benchmarks/compare.py and its llama.cpp helper, on things small enough for a test."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pdserve.bench import llamacpp

ROOT = Path(__file__).resolve().parents[2]


def add(tf: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def test_fetch_sources_unpacks_only_vendored_llama_cpp(tmp_path):
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    with tarfile.open(cache / "sdist" / "llama_cpp_python-9.9.9.tar.gz", "w:gz") as tf:
        add(tf, "llama_cpp_python-9.9.9/pyproject.toml")
        add(tf, "llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt", b"project(x)")
        add(tf, "llama_cpp_python-9.9.9/vendor/llama.cpp/tools/server/server.cpp")
        add(tf, "llama_cpp_python-9.9.9/vendor/other/CMakeLists.txt")
        link = tarfile.TarInfo("llama_cpp_python-9.9.9/vendor/llama.cpp/evil")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    src = llamacpp.fetch_sources(cache, log=lambda m: None)
    assert src == cache / "src"
    assert (src / "CMakeLists.txt").read_bytes() == b"project(x)"
    assert (src / "tools" / "server" / "server.cpp").exists()
    assert not (src / "evil").exists() and not (src / "pyproject.toml").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["sdist", "src"]
    # Unpacked once: a second call reuses it.
    assert llamacpp.fetch_sources(cache, log=lambda m: None) == src


def test_binaries_missing_and_cache_dir_env(tmp_path, monkeypatch):
    assert llamacpp.binaries(tmp_path) is None
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert llamacpp.cache_dir() == tmp_path / "llama.cpp"
    # AMX must stay off: its code path crashed with "Illegal instruction" on our CPUs.
    assert not [f for f in llamacpp.CMAKE_FLAGS if "AMX" in f and not f.endswith("=OFF")]
    assert "-DGGML_NATIVE=OFF" in llamacpp.CMAKE_FLAGS


def test_isa_flags_follow_the_cpu_and_builds_are_cached_per_feature_set(tmp_path):
    # An AVX2-only EPYC must get no AVX-512 (such a binary dies with "Illegal instruction" there).
    avx2 = llamacpp.isa_flags(frozenset({"avx", "avx2", "fma", "f16c", "bmi2"}))
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_VNNI=OFF" in avx2
    avx512 = llamacpp.isa_flags(frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni"}))
    assert (
        "-DGGML_AVX512=ON" in avx512
        and "-DGGML_AVX512_VNNI=ON" in avx512
        and "-DGGML_AVX512_BF16=OFF" in avx512
    )
    from pdserve.utils.cpu import feature_key

    assert llamacpp.build_dir(tmp_path) == tmp_path / f"build-{feature_key()}"


@pytest.mark.slow
def test_compare_runs_pdserve_and_skips_unbuilt_llama_server(tmp_path):
    out = tmp_path / "out"
    env = {**__import__("os").environ, "PDSERVE_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "compare.py"),
            "--systems",
            "pdserve-mixed,llama-server",
            "--model",
            "tiny-llama",
            "-n",
            "4",
            "-c",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--threads",
            "1",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "compare.json").read_text())["results"]
    assert "not built" in res["llama-server"]["skipped"]
    (pt,) = res["pdserve-mixed"]["points"]
    assert pt["completed"] == 4 and pt["failed"] == 0
    # ignore_eos: every request generated exactly --output-len tokens.
    assert pt["output_tokens"] == 4 * 8
    md = (out / "compare.md").read_text()
    assert "| pdserve-mixed | 1 | 2 | 4/0 |" in md and "skipped" in md
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_group_cpu_counts_processes_the_leader_never_waits_for(tmp_path):
    """A server whose worker burns CPU in a grandchild it never reaps (as vLLM's engine core): the
    group's CPU, taken as stop() begins, has it; this process's children's rusage would not."""
    from pdserve.bench.procs import ServerProcess, free_port

    burn = "import time; t = time.process_time(); [0 for _ in iter(lambda: time.process_time() - t > 0.5, True)]; time.sleep(60)"
    leader = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(60)"
    )
    srv = ServerProcess([sys.executable, "-c", leader], free_port(), tmp_path / "srv.log")
    import time

    deadline = time.monotonic() + 30
    while srv.group_cpu_s() < 0.5:
        assert time.monotonic() < deadline, "the grandchild's CPU never showed"
        time.sleep(0.2)
    srv.stop(grace=5)
    assert srv.cpu_s >= 0.5
