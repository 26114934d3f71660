from __future__ import annotations

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
