"""In one process: the EP step encoding round-trips, and the weight mover's double-buffered swap
changes which slots hold which experts without changing a single logit."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.model.attention import build_metadata
from pdserve.model.ep_protocol import Header, decode_step, encode_step
from pdserve.model.kernels import qgemm
from pdserve.model.loader import build_model, load_model_files

BLOCK = 4


def test_step_encoding_round_trips():
    # Two decodes of very different lengths (two groups), a first chunk and a later chunk with a
    # sliding-window mask: every kind of metadata the attention reads.
    seqs = [([0, 1], 0, 5), ([2, 3, 4, 5, 6, 7, 8, 9], 30, 1), ([10, 11, 12], 3, 1), ([13, 14], 6, 1)]
    seqs = sorted(seqs, key=lambda s: (s[2] != 1, s[1]))
    meta = build_metadata(seqs, BLOCK, 4, "cpu")
    ids, pos = torch.arange(8) + 100, torch.arange(8)
    h, ints, mask = encode_step(ids, pos, meta)
    h2 = Header.from_tensor(h.to_tensor())
    assert h2 == h
    ids2, pos2, meta2, _ = decode_step(h2, ints, mask, torch.device("cpu"))
    assert torch.equal(ids2, ids) and torch.equal(pos2, pos)
    assert torch.equal(meta2.slot_mapping, meta.slot_mapping)
    assert len(meta2.decode_groups) == len(meta.decode_groups) >= 2
    for a, b in zip(meta.decode_groups, meta2.decode_groups):
        assert a.start == b.start and torch.equal(a.block_idx, b.block_idx) and torch.equal(a.mask, b.mask)
    for a, b in zip(meta.prefills, meta2.prefills):
        assert (a.q_start, a.q_len, a.ctx_len) == (b.q_start, b.q_len, b.ctx_len)
        for x, y in ((a.block_idx, b.block_idx), (a.mask, b.mask)):
            assert (x is None and y is None) or torch.equal(x, y)


def _step(model, kv, ids, start):
    n = len(ids)
    meta = build_metadata([(list(range(16)), start, n)], BLOCK, None, "cpu")
    return model.forward(torch.tensor(ids), torch.arange(start, start + n), meta, kv, torch.tensor([n - 1]))


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_swap_keeps_logits_and_moves_weights(quant):
    """Quantized experts move as float ones do: a slot's packed tensors are copied whole."""
    torch.set_num_threads(1)
    loaded = load_model_files("tiny-mixtral")
    ref = build_model(loaded, model_config=ModelConfig(quantization=quant))
    ep = build_model(
        loaded, model_config=ModelConfig(quantization=quant, num_redundant_experts=4, eplb_interval=0)
    )
    a = ref.arch
    kv_ref, kv_ep = (torch.zeros(a.num_layers, 2, 64, a.num_kv_heads, a.head_dim) for _ in range(2))
    prompt = torch.randint(0, a.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    want, got = [_step(ref, kv_ref, prompt, 0)], [_step(ep, kv_ep, prompt, 0)]
    old = ep.model.phy2log.clone()
    store = [gu.dense().clone() for gu, _ in ep.model.expert_store]
    g = torch.Generator().manual_seed(1)
    placements = []
    for _ in range(2):  # twice: the second swap writes into the buffers the first one retired
        p = torch.stack(
            [
                torch.cat([torch.randperm(16, generator=g), torch.randint(0, 16, (4,), generator=g)])
                for _ in range(2)
            ]
        )
        placements.append(p)
    token = int(want[-1].argmax())
    for step in range(6):
        if step in (0, 3):
            ep.request_placement(placements[step // 3])
        want.append(_step(ref, kv_ref, [token], 12 + step))
        got.append(_step(ep, kv_ep, [token], 12 + step))
        token = int(want[-1].argmax())
        # A build runs beside the steps and commits at the first step after it is done: waiting for
        # it here makes that the next step, however busy the machine.
        deadline = time.monotonic() + 60
        while ep.mover.busy and not ep.mover.ready():
            assert time.monotonic() < deadline, "the placement build never finished"
            time.sleep(0.01)
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, atol=1e-4, rtol=1e-4)
    assert torch.equal(ep.model.phy2log, placements[1]) and not torch.equal(old, placements[1])
    assert ep.eplb.rebalances == 2 and ep.eplb.moved_total > 0
    for j, (block, row) in enumerate(zip(ep.model.blocks, placements[1])):
        assert torch.equal(block.placement.phy2log, row)
        assert torch.equal(ep.model.expert_store[j][0].dense(), store[j])  # the source is never written
        assert torch.equal(block.placement.gate_up.dense(), store[j][row])  # every slot holds its expert
        assert block.placement.gate_up.kind == {"none": "f32"}.get(quant, quant) or not qgemm.available()


def test_initial_slots_are_views_of_the_store_and_never_overwritten():
    """Without redundant slots the experts are in memory once; the first move allocates buffers."""
    loaded = load_model_files("tiny-qwen3-moe")
    ep = build_model(loaded, model_config=ModelConfig(eplb_interval=0))
    gu = ep.model.expert_store[0][0]
    assert ep.model.blocks[0].placement.gate_up.shares_storage(gu)
    before = gu.dense().clone()
    ep.mover.prepare(torch.stack([torch.arange(16).flip(0)] * len(ep.model.blocks)))
    assert ep.mover.commit() == 0  # a reorder inside the rank copies nothing from the host
    assert torch.equal(gu.dense(), before)
    assert torch.equal(ep.model.blocks[0].placement.gate_up.dense(), before.flip(0))
