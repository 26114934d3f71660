from __future__ import annotations

import random

import pytest

from pdserve.model.attention import MAX_DECODE_GROUPS, build_metadata, group_by_length


def test_groups_cover_every_decode_in_order_and_cut_padding():
    lens = sorted([33, 40, 41, 120, 130, 128, 400, 410, 700, 720])
    groups = group_by_length(lens)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert len(groups) <= MAX_DECODE_GROUPS
    seqs = [(list(range(i * 50, i * 50 + 46)), n - 1, 1) for i, n in enumerate(lens)]
    meta = build_metadata(seqs, 16, None, "cpu")
    assert meta.padded_decode_slots < 0.6 * max(lens) * len(lens)
    assert sum(int(g.mask.sum()) for g in meta.decode_groups) == sum(lens)


def test_equal_lengths_make_one_group():
    assert group_by_length([64] * 8) == [(0, 8)]
    assert group_by_length([]) == []


def _reference_slots(seqs, bs):
    return [
        table[p // bs] * bs + p % bs for table, computed, new in seqs for p in range(computed, computed + new)
    ]


@pytest.mark.parametrize("window", [None, 24])
def test_metadata_matches_a_position_by_position_reference(window):
    """Slots, block rows, masks and bounds of decodes mixed with prefill chunks, read one position at a time."""
    bs = 16
    rng = random.Random(3)
    seqs = []
    for i, ctx in enumerate(sorted(rng.randrange(2, 300) for _ in range(7))):
        seqs.append((rng.sample(range(1000), -(-ctx // bs)), ctx - 1, 1))  # decodes, ascending
    seqs += [(rng.sample(range(1000, 2000), 3), 0, 40), (rng.sample(range(2000, 3000), 5), 33, 20)]
    meta = build_metadata(seqs, bs, window, "cpu")
    assert meta.slot_mapping.tolist() == _reference_slots(seqs, bs)
    decodes = [(t, c + 1) for t, c, n in seqs if n == 1]
    seen = 0
    for g in meta.decode_groups:
        first, ctx = g.bounds
        assert g.start == seen
        for i in range(g.block_idx.shape[0]):
            table, want_ctx = decodes[seen + i]
            want_first = max(0, want_ctx - window) if window else 0
            nblk = -(-want_ctx // bs)
            assert g.block_idx[i, :nblk].tolist() == table[:nblk] and not g.block_idx[i, nblk:].any()
            row = g.mask[i].reshape(-1).tolist()
            assert row == [want_first <= p < want_ctx for p in range(len(row))]
            assert (int(first[i]), int(ctx[i])) == (want_first, want_ctx)
        g.bounds = None  # the mask's own reading agrees
        assert [t.tolist() for t in g.attended()] == [first.tolist(), ctx.tolist()]
        seen += g.block_idx.shape[0]
    assert seen == len(decodes) and len(meta.prefills) == 2
