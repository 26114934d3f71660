"""Float32 results checked against a float64 reference, within a rounding-error bound derived from
the inputs (Higham's gamma_n = n*u / (1 - n*u), u = 2^-24). A fixed tolerance against another float32
implementation fails on whichever CPU sums in another order (Intel's torch takes other paths than
AMD's); a bound from the inputs holds on every CPU and still rejects a real error, which moves the
result by far more than the roundings can."""

from __future__ import annotations

import torch

U32 = 2.0**-24


def gamma(n: int | torch.Tensor) -> float | torch.Tensor:
    """The relative error bound of n float32 roundings in a row (a dot product of length n)."""
    return n * U32 / (1 - n * U32)


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - ref| <= bound element by element; the message names the worst element and its ratio."""
    assert got.shape == ref.shape == bound.shape, (got.shape, ref.shape, bound.shape)
    err = (got.double() - ref.double()).abs()
    ratio = err / bound.double().clamp_min(1e-300)
    worst = int(ratio.argmax())
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements beyond the rounding bound; worst at "
        f"{worst}: |{got.flatten()[worst].item()} - {ref.flatten()[worst].item()}| = {err.flatten()[worst].item():.3g} "
        f"> {bound.flatten()[worst].item():.3g} ({ratio.flatten()[worst].item():.3g}x)"
    )


def matmul_bound(x: torch.Tensor, w: torch.Tensor, extra: int = 2) -> torch.Tensor:
    """Bound on |fl(x @ w.T) - x @ w.T| for float32 x [M, K], w [N, K], in any summation order."""
    k = x.shape[-1]
    return gamma(k + extra) * (x.double().abs() @ w.double().abs().t())


def attention64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention in float64. q [R, D]; k, v [R, L, D] (each query row's own keys) or [L, D]
    (keys shared by every row); keep [R, L] bool: the keys the row attends (at least one each)."""
    shared = k.dim() == 2
    s = torch.einsum("rd,ld->rl" if shared else "rd,rld->rl", q.double(), k.double()) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("rl,ld->rd" if shared else "rl,rld->rd", torch.softmax(s, -1), v.double())


def attention_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bound on a float32 attention's error, row by row [R, D], whatever its order of sums or its
    blocking (online softmax included). A score's error is at most gamma(D + 2) * scale * sum|q k|;
    an error e in the scores moves each softmax weight by a factor within exp(+-2e); the exp, the sum
    of weights and the weighted sum of values add (2 L + 16) roundings. All relative to max |v|."""
    d = q.shape[-1]
    keep64 = keep.double()
    shared = k.dim() == 2
    qk = torch.einsum("rd,ld->rl" if shared else "rd,rld->rl", q.double().abs(), k.double().abs()) * abs(
        scale
    )
    e_score = gamma(d + 2) * (qk * keep64).amax(-1)  # [R]
    n_keys = keep64.sum(-1)  # [R]
    if shared:  # the max over all keys: a bound still, without an [R, L, D] tensor
        vmax = v.double().abs().amax(0).expand(q.shape[0], -1)  # [R, D]
    else:
        vmax = (v.double().abs() * keep64[..., None]).amax(1)  # [R, D]
    rel = torch.expm1(2 * e_score) + gamma(2 * n_keys + 16)
    return rel[:, None] * vmax
