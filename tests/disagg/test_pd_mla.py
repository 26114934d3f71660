"""A multi-head latent attention model disaggregated: the prefill worker ships the latent rows layer by
layer (one plane per layer, kv_lora_rank + qk_rope_head_dim values a token) and the decode worker's
32 greedy tokens equal the mixed engine's, over shm and tcp, and for a resumed (migrated) stream."""

from __future__ import annotations

import pytest
from pd_harness import Loop, pd_config, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.disagg.trust import compat_info, compat_mismatch
from pdserve.engine.engine import LLMEngine
from pdserve.model.arch import TINY_CONFIGS
from pdserve.server.roles import build_engine

MLA = "tiny-deepseek-v3"
TOKENS = 32


def _mixed(prompt_list, params, device_blocks: int = 64) -> dict[str, list[int]]:
    e = LLMEngine(pd_config("mixed", device_blocks=device_blocks, overrides={"model.name": MLA}))
    try:
        for i, p in enumerate(prompt_list):
            e.add_request(f"r{i}", p, params)
        want: dict[str, list[int]] = {}
        for out in e.run_until_idle():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)
        return want
    finally:
        e.close()


def _pair(backend: str):
    return pd_pair(
        backend,
        prefill_config=pd_config("prefill", backend, overrides={"model.name": MLA}),
        decode_overrides={"model.name": MLA},
    )


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_equals_mixed(backend):
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompt_list = prompts(5)
    want = _mixed(prompt_list, params)
    with _pair(backend) as (prefill, decode):
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 5 and s["kv_transfers_failed_total"] == 0
        a = decode.engine.arch
        assert decode.engine.kv_cache.shape[1:2] + decode.engine.kv_cache.shape[3:] == (1, 1, 40)
        # Whole blocks of latent rows went over: a multiple of one block's latent bytes.
        sent = prefill.engine.stats()["kv_send_bytes_total"]
        block_bytes = a.num_layers * 4 * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
        assert sent > 0 and sent % block_bytes == 0
        decode.wait_idle()
        prefill.wait_idle()


def test_resumed_stream_continues_exactly():
    """A stream migrated to a decode worker arrives with its tokens so far; the prefill worker computes
    prompt + those tokens and the decode worker continues with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompt = prompts(6)[5]
    full = _mixed([prompt], params)["r0"]
    with _pair("shm") as (prefill, decode):
        decode.submit(lambda e: e.add_request("m", prompt, params, output_token_ids=full[:10]))
        decode.wait(["m"])
        assert decode.outputs["m"] == full[10:]
        assert decode.engine.stats()["prefill_tokens_computed"] == 0
        decode.wait_idle()
        prefill.wait_idle()


def test_the_kv_layout_is_part_of_the_compatibility_check():
    """Two pools of one shape whose rows mean different things (another latent/rope split) disagree."""
    v3, kimi = TINY_CONFIGS["tiny-deepseek-v3"], TINY_CONFIGS["tiny-kimi"]
    other = type(v3)(**{**v3.__dict__, "kv_lora_rank": 36, "qk_rope_head_dim": 4})
    assert other.kv_cache_shape(64) == v3.kv_cache_shape(64)
    shape = list(v3.kv_cache_shape(64))
    mine = compat_info("m", "float32", "none", 4, shape, 4, v3.kv_layout_name)
    assert compat_mismatch(mine, compat_info("m", "float32", "none", 4, shape, 4, v3.kv_layout_name)) is None
    assert "kv_layout" in compat_mismatch(
        mine, compat_info("m", "float32", "none", 4, shape, 4, other.kv_layout_name)
    )
    assert (
        kimi.kv_layout_name == v3.kv_layout_name
    )  # the same latent layout: only the model name tells them apart
    # A K/V pool and a latent pool differ in their planes too.
    dense = TINY_CONFIGS["tiny-deepseek-moe"]
    theirs = compat_info("m", "float32", "none", 4, list(dense.kv_cache_shape(64)), 4, dense.kv_layout_name)
    assert "kv_planes" in compat_mismatch(mine, theirs)


def test_parity_depends_on_the_transferred_latents(monkeypatch):
    """The control for the parity tests: with the layer writes dropped, outputs differ."""
    from pdserve.disagg.transports.shm import ShmWriter

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt_list = prompts(4)[1:]
    want = _mixed(prompt_list, params)
    monkeypatch.setattr(ShmWriter, "write_layer", lambda self, rid, layer, runs: 0)
    with _pair("shm") as (_, decode):
        decode.run(prompt_list, params)
        assert decode.outputs != want


def test_two_prefill_workers_in_a_pipeline_give_the_mixed_output():
    """A long prompt cut between two prefill workers: the second chunk's worker reads the first
    chunk's latents from the decode worker's pool, both write theirs into it."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompt_list = [[(11 * i + 7 * j) % 250 + 1 for j in range(70 + 9 * i)] for i in range(2)]
    want = _mixed(prompt_list, params, 96)
    prefill_cfg = {"model.name": MLA, "scheduler.max_num_batched_tokens": 256}
    prefills = [Loop(build_engine(pd_config("prefill", "auto", 96, prefill_cfg))) for _ in range(2)]
    decode = None
    try:
        decode = Loop(
            build_engine(
                pd_config(
                    "decode",
                    "auto",
                    96,
                    {"model.name": MLA},
                    prefill_endpoints=[p.engine.connector.endpoint for p in prefills],
                    parallel_prefill_min_tokens=32,
                    bootstrap_timeout_s=0.5,
                    quarantine_timeout_s=5.0,
                )
            )
        )
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_parallel_prefills_total"] == 2 and s["kv_parallel_prefill_chunks_total"] == 4
        decode.wait_idle()
        for p in prefills:
            p.wait_idle()
    finally:
        if decode is not None:
            decode.stop()
        for p in prefills:
            p.stop()
