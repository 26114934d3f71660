"""The decode products' prefetch distance chosen on the served model (engine/prefetch_tuning.py): the
rule, where it is measured, the measurement on KV blocks borrowed and returned, its cache, and the
kernel taking the choice."""

from __future__ import annotations

import json

import pytest

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine import prefetch_tuning
from pdserve.engine.engine import LLMEngine
from pdserve.model.kernels import qgemm, tuning

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="no C compiler here")


def _config(**more):
    return load_config(
        None,
        {
            "model.name": "tiny-llama",
            "model.quantization": "int4",
            "server.threads": 1,
            "cache.block_size": 4,
            "cache.device_blocks": 64,
            **more,
        },
    )


@pytest.fixture
def kernel_distance():
    before = qgemm.prefetch_bytes()
    yield
    qgemm.prefetch(before)


def test_the_shortest_distance_within_two_percent_of_the_fastest():
    assert tuning.choose_prefetch({2048: 1.0, 4096: 0.9, 8192: 0.8, 16384: 0.85}) == 8192
    assert tuning.choose_prefetch({2048: 0.81, 4096: 0.9, 8192: 0.8, 16384: 0.85}) == 2048
    assert tuning.choose_prefetch({2048: 1.0, 4096: 1.0, 8192: 1.0, 16384: 1.0}) == 2048


@pytest.fixture
def core_cache(monkeypatch):
    """A core's own cache of 1 MB, whatever this CPU's: the rule's bound is the same on every machine."""
    monkeypatch.setattr(prefetch_tuning, "core_cache_bytes", lambda: 1 << 20)


def test_measured_only_where_quantized_register_rows_stream_from_memory(core_cache):
    big = 1 << 40
    assert prefetch_tuning.applies(_config(), big)
    assert prefetch_tuning.applies(_config(**{"model.quantization": "int8"}), big)
    assert not prefetch_tuning.applies(_config(), 2 << 20)  # fits its thread's own cache twice
    assert prefetch_tuning.applies(_config(), (2 << 20) + 1)
    # Two threads have two cores' caches: the same weights now fit them.
    assert not prefetch_tuning.applies(_config(**{"server.threads": 2}), (2 << 20) + 1)
    assert prefetch_tuning.applies(_config(), 1 << 20, min_bytes=0)
    assert not prefetch_tuning.applies(_config(**{"model.quantization": "none"}), big)
    assert not prefetch_tuning.applies(_config(**{"model.activation_quantization": "int8"}), big)
    assert not prefetch_tuning.applies(_config(**{"model.gemm_kernel": "torch"}), big)


def test_measured_on_borrowed_blocks_cached_and_applied(tmp_path, monkeypatch, kernel_distance):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(prefetch_tuning, "core_cache_bytes", lambda: 1 << 30)
    engine = LLMEngine(_config())
    try:
        assert engine.prefetch_bytes is None  # the weights fit the cores' caches: nothing measured
        parts = {"model": "tiny-llama", "threads": 1}
        args = (engine.model, engine.kv_cache, engine.pool, engine.block_size, parts)
        chosen = prefetch_tuning.tune_prefetch(*args)
        assert engine.pool.num_free == engine.pool.num_blocks  # the borrowed blocks went back
        assert chosen in tuning.PREFETCH_BYTES and qgemm.prefetch_bytes() == chosen
        [path] = (tmp_path / "kernels").glob("prefetch-*.json")
        data = json.loads(path.read_text())
        assert data["prefetch_bytes"] == chosen
        assert set(data["step_ms"]) == {str(b) for b in tuning.PREFETCH_BYTES}
        assert all(ms > 0 for ms in data["step_ms"].values())

        # Read back, not measured again: a cached choice is applied as it is.
        def measured(*_a, **_k):
            raise AssertionError("measured again")

        monkeypatch.setattr(tuning, "measure_prefetch", measured)
        path.write_text(json.dumps({**data, "prefetch_bytes": 16384}))
        assert prefetch_tuning.tune_prefetch(*args) == 16384 and qgemm.prefetch_bytes() == 16384
        # Another thread count is another key: measured (here: refused by the stub).
        with pytest.raises(AssertionError, match="measured again"):
            prefetch_tuning.tune_prefetch(*args[:-1], {**parts, "threads": 2})
        assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.close()


def test_an_engine_whose_weights_stream_measures_at_start_and_serves(tmp_path, monkeypatch, kernel_distance):
    """With cores' caches smaller than its weights the engine measures when it starts, and its
    requests run as they do at the kernel's own distance, bit for bit."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(engine):
        engine.add_request("r", [5, 9, 17, 33, 65, 129], params)
        out = [(o.new_token_ids, [lp.logprob for lp in o.new_logprobs]) for o in engine.run_until_idle()]
        assert engine.pool.num_free == engine.pool.num_blocks
        return out

    qgemm.prefetch(512)
    monkeypatch.setattr(prefetch_tuning, "core_cache_bytes", lambda: 1 << 30)
    plain = LLMEngine(_config())
    try:
        assert plain.prefetch_bytes is None
        want = run(plain)
    finally:
        plain.close()
    monkeypatch.setattr(prefetch_tuning, "core_cache_bytes", lambda: 1024)
    engine = LLMEngine(_config())
    try:
        assert engine.prefetch_bytes in tuning.PREFETCH_BYTES
        assert qgemm.prefetch_bytes() == engine.prefetch_bytes != 512
        assert engine.pool.num_free == engine.pool.num_blocks
        assert run(engine) == want
    finally:
        engine.close()
