"""A long prefill chunk after computed context: the context attended whole and the chunk causally,
merged by log-sum-exp (model/chunk_attention.py), gives the masked attention's values, within the
rounding bound of a float64 reference."""

from __future__ import annotations

import torch
from float_bounds import assert_within, attention64, attention_bound

from pdserve.model.attention import build_metadata, paged_attention
from pdserve.model.chunk_attention import MIN_QUERIES, prefix_then_causal


def _check_heads(got, q, k, v, mask, scale):
    """got, q [H, N, D]; k, v [KVH, L, D]; mask [N, L]: each head against float64 within the bound."""
    group = q.shape[0] // k.shape[0]
    for h in range(q.shape[0]):
        kh, vh = k[h // group], v[h // group]
        want = attention64(q[h], kh, vh, mask, scale)
        assert_within(got[h], want, attention_bound(q[h], kh, vh, mask, scale), f"head {h}")


def test_split_equals_one_masked_call():
    torch.manual_seed(0)
    h, kvh, d, p, n = 9, 3, 64, 300, 280
    q, k, v = torch.randn(1, h, n, d), torch.randn(1, kvh, p + n, d), torch.randn(1, kvh, p + n, d)
    mask = torch.arange(p + n)[None] <= torch.arange(p, p + n)[:, None]
    got = prefix_then_causal(q, k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:], d**-0.5)
    _check_heads(got[0], q[0], k[0], v[0], mask, d**-0.5)


def test_paged_attention_takes_the_split_for_a_long_chunk_only():
    torch.manual_seed(1)
    bs, h, kvh, d = 16, 4, 2, 32
    computed, n = 200, MIN_QUERIES + 9  # a prefix that ends inside a block
    blocks = torch.randperm(64)[: -(-(computed + n) // bs)].tolist()
    k_cache, v_cache = torch.randn(64 * bs, kvh, d), torch.randn(64 * bs, kvh, d)
    q, k, v = torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    meta = build_metadata([(blocks, computed, n)], bs, None, "cpu")
    assert meta.prefills[0].prefix_len == computed and meta.prefills[0].mask is None
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5)
    short = build_metadata([(blocks, computed + n - 5, 5)], bs, None, "cpu")
    assert short.prefills[0].prefix_len == 0 and short.prefills[0].mask is not None
    # Reference: the whole context gathered in order, causal over the chunk, in float64.
    kc, vc = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(computed + n)])
    kc[slots[computed:]], vc[slots[computed:]] = k, v
    mask = torch.arange(computed + n)[None] <= torch.arange(computed, computed + n)[:, None]
    _check_heads(
        got.transpose(0, 1),
        q.transpose(0, 1),
        kc[slots].transpose(0, 1),
        vc[slots].transpose(0, 1),
        mask,
        d**-0.5,
    )
