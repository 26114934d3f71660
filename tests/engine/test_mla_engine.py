"""Multi-head latent attention models in the engine: greedy outputs through paged chunked prefill
and absorbed decode equal transformers' own greedy tokens, and stay the same on a prefix-cache hit
and when the prefix comes back from the host tier (the KV those paths move is the latent rows)."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import default_gguf_path, load_gguf_tokenizer, load_model_files

MODEL = "tiny-deepseek-v3"
BS = 4
TOKENS = 32


def _config(model: str, **overrides):
    return load_config(
        None,
        {
            "model.name": model,
            "cache.block_size": BS,
            "cache.device_blocks": 64,
            "scheduler.max_num_batched_tokens": 16,  # prompts of 30+ tokens prefill in chunks
            **overrides,
        },
    )


def _run(e: LLMEngine, rid: str, ids: list[int]) -> tuple[list[int], list[float]]:
    e.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0))
    tokens, logprobs = [], []
    for out in e.run_until_idle(lambda _: e.pool.check_integrity()):
        tokens += out.new_token_ids
        logprobs += [lp.logprob for lp in out.new_logprobs]
    assert e.pool.num_free == e.pool.num_blocks
    return tokens, logprobs


def _same(got, ref) -> bool:
    """Equal tokens, and logprobs equal up to the float noise of another chunk shape (KV restored
    into the wrong place can still give the same few tokens; not the same logprobs)."""
    return got[0] == ref[0] and max(abs(a - b) for a, b in zip(got[1], ref[1])) < 1e-3


def _prompt(seed: int, n: int = 34) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_greedy_tokens_match_hf(tmp_path, version):
    """A checkpoint written by transformers, served from its directory: 32 greedy tokens through
    chunked prefill (chunks of 16 over cached latents) and absorbed decode == transformers' argmax
    of a whole forward at every step."""
    import transformers as tf

    cfg_cls, model_cls = (
        (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)
        if version == "v2"
        else (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)
    )
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707 if version == "v2" else 1.0,
        "mscale_all_dim": 0.707 if version == "v2" else 1.0,
    }
    cfg = cfg_cls(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        kv_lora_rank=32,
        q_lora_rank=24 if version == "v3" else None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        rope_parameters=yarn,
    )
    torch.manual_seed(0)
    hf = model_cls(cfg)
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(20.0)
    hf = hf.eval().float()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))

    e = LLMEngine(_config(str(tmp_path)))
    try:
        assert e.arch.is_mla and e.kv_cache.shape[1:2] + e.kv_cache.shape[3:] == (1, 1, 40)
        for seed in (1, 2):
            ids = _prompt(seed)
            got, _ = _run(e, f"r{seed}", ids)
            want, seq = [], list(ids)
            with torch.no_grad():
                for _ in range(TOKENS):
                    want.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
                    seq.append(want[-1])
            assert got == want
    finally:
        e.close()


def test_prefix_cache_hit_gives_the_same_tokens(loaded):
    e = LLMEngine(_config(MODEL), loaded=loaded)
    try:
        p = _prompt(3)
        ref = _run(e, "p1", p)
        before = e.stats()["prefill_tokens_computed"]
        assert _same(_run(e, "p2", p), ref)
        # The cached full blocks were not computed again (the last, partial one always is).
        assert e.stats()["prefill_tokens_computed"] - before == len(p) - (len(p) // BS) * BS
    finally:
        e.close()


def test_prefix_from_the_host_tier_gives_the_same_tokens(loaded):
    e = LLMEngine(_config(MODEL, **{"cache.device_blocks": 24, "cache.host_cache_gb": 0.01}), loaded=loaded)
    try:
        p = _prompt(4, 30)
        ref = _run(e, "p1", p)
        blocks = e.pool.allocate(e.pool.num_free)  # evicts every cached block into the host tier
        e.pool.free(blocks)
        assert e.prefix_cache.match(prompt_hashes(p, BS)) == [] and e.tiers.store.flush(10)
        host_block = e.tiers.store.host.get(prompt_hashes(p, BS)[0])
        assert host_block.shape == (e.arch.num_layers, 1, BS, 1, 40)  # a block of latent rows only
        before = e.stats()["prefill_tokens_computed"]
        assert _same(_run(e, "p2", p), ref)
        s = e.stats()
        assert s["prefill_tokens_computed"] - before == len(p) - (len(p) // BS) * BS
        assert s["tier_host_hits_total"] >= len(p) // BS and s["tier_fetch_fallbacks_total"] == 0

        # The control: the same blocks with their latents zeroed give another output.
        blocks = e.pool.allocate(e.pool.num_free)
        e.pool.free(blocks)
        for h in prompt_hashes(p, BS)[: len(p) // BS]:
            e.tiers.store.host.get(h).zero_()
        assert not _same(_run(e, "p3", p), ref)
    finally:
        e.close()


def test_prefix_from_the_disk_tier_gives_the_same_tokens(loaded, tmp_path):
    tier = {"cache.device_blocks": 24, "cache.disk_cache_dir": str(tmp_path), "cache.disk_cache_gb": 0.01}
    e = LLMEngine(_config(MODEL, **tier), loaded=loaded)
    try:
        p = _prompt(7, 30)
        ref = _run(e, "p1", p)
        blocks = e.pool.allocate(e.pool.num_free)  # evicts every cached block onto disk
        e.pool.free(blocks)
        assert e.tiers.store.host is None and e.tiers.store.flush(10)
        before = e.stats()["prefill_tokens_computed"]
        assert _same(_run(e, "p2", p), ref)
        s = e.stats()
        assert s["prefill_tokens_computed"] - before == len(p) - (len(p) // BS) * BS
        assert s["tier_disk_hits_total"] == len(p) // BS and s["tier_disk_corrupt_total"] == 0
    finally:
        e.close()


def test_expert_parallel_ranks_share_the_latent_pool():
    """Two expert-parallel ranks map rank 0's latent pool (one plane per layer) and give EP=1's tokens."""
    from pdserve import LLM

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompt_list = [_prompt(5, 13), _prompt(6, 22)]
    outs = []
    for ep in (1, 2):
        llm = LLM(model=MODEL, threads=1, device_blocks=64, model__expert_parallel=ep)
        try:
            outs.append([o.token_ids for o in llm.generate(prompt_list, params)])
        finally:
            llm.engine.close()
    assert outs[0] == outs[1]
