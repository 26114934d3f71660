"""Steps that borrow an idle worker's threads (utils/core_share.py) compute the same bits as on the
worker's own: the same tokens and exactly the same logprobs (the prompts' too), float32 and
quantized, dense, MoE and MLA, with the KV pool back at its start (a MoE router's float32 product
once gave other bits on two threads when long prompts shared the batch). Prefill steps borrow where
the fused decode step runs the model, and hand a peer that gets work its thread back after a layer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.utils.core_share import CoreShare

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing needs two cores")

PROMPTS = [
    torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    for i, n in enumerate([9 + 3 * i for i in range(10)] + [300, 700])  # past 256 rows: a prefill's paths
]


@pytest.fixture(scope="module")
def idle_peer(tmp_path_factory):
    """A live process's entry in a core-sharing directory, idle, lending one thread."""
    d = tmp_path_factory.mktemp("cores")
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (d / str(peer.pid)).write_bytes(b"\0\0\0\0" + (1).to_bytes(4, "little"))
    yield d
    peer.kill()
    peer.wait()


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for o in engine.run_until_idle():
        toks, lps = out.setdefault(o.request_id, ([], []))
        toks += o.new_token_ids
        lps += [lp.logprob for lp in o.new_logprobs]
        lps += [lp.logprob for lp in o.prompt_logprobs or [] if lp is not None]
    assert engine.pool.num_free == engine.pool.num_blocks
    return out


@pytest.mark.parametrize(
    "model,quantization",
    [
        ("tiny-llama", "none"),
        ("tiny-llama", "int8"),
        ("tiny-llama", "int4"),
        ("tiny-mixtral", "int4"),
        ("tiny-deepseek-v3", "none"),
    ],
)
def test_borrowed_threads_compute_the_same_bits(idle_peer, model, quantization):
    config = load_config(
        None,
        {
            "model.name": model,
            "model.quantization": quantization,
            "server.threads": 1,
            "cache.block_size": 4,
            "cache.device_blocks": 256,
            "scheduler.max_num_seqs": 12,
            # Both runs prefill every prompt whole: a prefix hit computes the rest in other shapes.
            "cache.prefix_cache": False,
        },
    )
    engine = LLMEngine(config)
    try:
        own = _run(engine)
        assert torch.get_num_threads() == 1
        engine.core_share = CoreShare(idle_peer, 1)
        borrowed = _run(engine)
        stats = engine.stats()
        assert stats["decode_steps_borrowing_total"] == engine.borrowing_steps > 0
        assert torch.get_num_threads() == 2  # the last step was a decode step, with the peer's thread
        fused = getattr(engine.model, "fused", None) is not None
        assert fused == (model == "tiny-llama")
        assert (stats["prefill_steps_borrowing_total"] > 0) == fused
    finally:
        engine.close()
    assert borrowed == own


def test_a_prefill_step_hands_the_thread_back_after_a_layer(tmp_path):
    """The peer gets work during a borrowing prefill step: the layers after the next look run on
    the worker's own thread, and the prompt's logprobs are those of a run that never borrowed."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    entry = tmp_path / str(peer.pid)
    entry.write_bytes(b"\0\0\0\0" + (1).to_bytes(4, "little"))
    config = load_config(
        None,
        {
            "model.name": "tiny-llama",
            "model.quantization": "int4",
            "server.threads": 1,
            "cache.prefix_cache": False,
        },
    )
    engine = LLMEngine(config)
    try:
        own = _run(engine)
        engine.core_share = CoreShare(tmp_path, 1)
        seen: list[int] = []
        execute = engine.runner.execute

        def watched(scheduled, layer_done=None):
            def hook(i: int) -> None:
                seen.append(torch.get_num_threads())
                if len(seen) == 1:  # after the first step's first layer
                    entry.write_bytes(b"\1\0\0\0" + (1).to_bytes(4, "little"))  # the peer is busy now
                if layer_done is not None:
                    layer_done(i)

            return execute(scheduled, hook)

        engine.runner.execute = watched
        borrowed = _run(engine)
    finally:
        engine.close()
        peer.kill()
        peer.wait()
    layers = len(engine.model.layers)
    assert layers >= 2
    assert seen[:layers] == [2] + [1] * (layers - 1)  # the first step, a prefill
    assert borrowed == own
