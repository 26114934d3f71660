from __future__ import annotations

import pytest
import torch

from pdserve.model.kernels import argmax as native
from pdserve.model.kernels.native import _compiler


@pytest.fixture(autouse=True)
def _kernel_loads():
    if _compiler() is None:
        pytest.skip("no C compiler here: torch's argmax runs instead")
    assert native._fn() is not None, "the argmax kernel did not build"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 49152])
def test_matches_torch_argmax_on_random_rows(n, threads):
    torch.manual_seed(n)
    x, before = torch.randn(9, n), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native.argmax_rows(x) == x.argmax(-1).tolist()
        half = x[:, : max(1, n // 2)]  # rows apart by more than their length
        assert native.argmax_rows(half) == half.argmax(-1).tolist()
    finally:
        torch.set_num_threads(before)


def test_ties_nan_and_infinities_answer_as_torch_does():
    n = 1000
    rows = torch.zeros(8, n)
    rows[0, [300, 700]] = 5.0  # a tie: the first
    rows[1, 600] = float("nan")  # NaN wins, wherever the max is
    rows[1, 900] = 9.0
    rows[2, [400, 800]] = float("nan")  # the first NaN
    rows[3] = float("-inf")  # all -inf: index 0
    rows[4, 999] = float("inf")
    rows[5] = -0.0
    rows[5, 500] = 0.0  # -0.0 == 0.0: the first
    rows[6] = torch.arange(n, dtype=torch.float32).flip(0)
    rows[7, 0] = float("nan")
    assert native.argmax_rows(rows) == rows.argmax(-1).tolist()
    assert native.argmax_rows(rows) == [300, 600, 400, 0, 999, 0, 0, 0]


def test_other_dtypes_take_torchs_path():
    x = torch.randn(3, 50, dtype=torch.float64)
    assert native.argmax_rows(x) == x.argmax(-1).tolist()
