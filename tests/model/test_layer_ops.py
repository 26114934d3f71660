"""The fused forms of the layer's small ops give the same values as the reference formulas."""

import torch
from float_bounds import assert_within, gamma

from pdserve.model.llama import rms_norm
from pdserve.model.quant import QuantizedWeight, quantize
from pdserve.model.rotary import apply_rotary


def _reference_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rms_norm64(x, weight, eps):
    x64 = x.double()
    return weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def _check_rms_norm(got, x, weight, eps):
    """Against float64: the mean of squares is off by gamma(D), its rsqrt by half that plus its own
    roundings, the two products by one each."""
    want = _rms_norm64(x, weight, eps)
    assert_within(got, want, gamma(x.shape[-1] // 2 + 8) * want.abs() + 1e-37, "rms_norm")


def test_fused_rms_norm_is_bit_identical_to_the_formula():
    # Heads (3-d, q/k norms) run torch's fused form: bit for bit the formula.
    g = torch.Generator().manual_seed(0)
    for shape, eps in [((5, 9, 64), 1e-6), ((3, 2, 576), 1e-5)]:
        x = torch.randn(*shape, generator=g) * 3
        w = torch.randn(shape[-1], generator=g)
        assert torch.equal(rms_norm(x, w, eps), _reference_rms_norm(x, w, eps))


def test_native_rms_norm_of_rows_matches_the_formula():
    # Rows of the residual stream run norm.c: the same formula, its sum of squares in another order.
    from pdserve.model.kernels.norm import native_rms_norm

    g = torch.Generator().manual_seed(0)
    for shape, eps in [
        ((1, 576), 1e-5),
        ((37, 576), 1e-6),
        ((128, 64), 1e-5),
        ((300, 960), 1e-6),
        ((2, 36), 1e-5),
    ]:
        x = torch.randn(*shape, generator=g) * 3
        w = torch.randn(shape[-1], generator=g)
        got = native_rms_norm(x, w, eps)
        assert got is not None and got.shape == x.shape
        _check_rms_norm(got, x, w, eps)
        torch.testing.assert_close(rms_norm(x, w, eps), got, rtol=0, atol=0)
    # Strided rows (a slice of a wider tensor) read in place; what the kernel cannot take falls back.
    wide = torch.randn(7, 1152, generator=g)
    w = torch.randn(576, generator=g)
    _check_rms_norm(native_rms_norm(wide[:, 576:], w, 1e-5), wide[:, 576:], w, 1e-5)
    assert native_rms_norm(wide[:, :576].double(), w.double(), 1e-5) is None
    assert native_rms_norm(wide[:, ::2], w, 1e-5) is None


def test_one_rotary_pass_over_q_and_k_equals_two():
    g = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 6, 9, 3, 64
    qk = torch.randn(t, heads + kv_heads, d, generator=g)
    cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
    both = apply_rotary(qk, cos, sin)
    assert torch.equal(both[:, :heads], apply_rotary(qk[:, :heads], cos, sin))
    assert torch.equal(both[:, heads:], apply_rotary(qk[:, heads:], cos, sin))


def test_native_rotary_pass_equals_the_op_by_op_one():
    """layer.c's rotary pass over q's and k's heads of the qkv rows, in place: the torch formula's
    values bit for bit (each product rounded on its own), on one thread and on several."""
    from pdserve.model.kernels.layer import rope_rows

    g = torch.Generator().manual_seed(3)
    for t, heads, kv_heads, d, threads in [(6, 9, 3, 64, 1), (1, 4, 2, 16, 2), (600, 8, 2, 64, 2)]:
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 4
        cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
        qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # rows strided past v
        x1, x2 = (h.double() for h in qk.chunk(2, -1))
        want = apply_rotary(qk, cos, sin)
        v = qkv[:, (heads + kv_heads) * d :].clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert rope_rows(qk, cos, sin)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(qk, want), (t, heads, d)
        assert torch.equal(qkv[:, (heads + kv_heads) * d :], v)  # v's heads untouched
        # Against float64: two products and their difference, each rounded once.
        c, s_ = cos.double(), sin.double()
        exact = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), -1)
        size = torch.cat(((x1 * c).abs() + (x2 * s_).abs(), (x2 * c).abs() + (x1 * s_).abs()), -1)
        assert_within(qk, exact, gamma(2) * size + 1e-37, "rope")
    # What the kernel does not take is left to torch, untouched.
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    ones = torch.ones(3, 1, 8, dtype=torch.float64)
    assert not rope_rows(x, ones, ones)


def test_int4_dequantization_from_nibbles_equals_addcmul_over_the_values():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    st = quantize(w, "int4")
    n = st.q.shape[0]
    expected = torch.addcmul(st.zero[..., None], st.q.view(n, -1, 32).float(), st.scale[..., None]).view(
        n, -1
    )
    got = QuantizedWeight(st).dequantize()
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, st.dequantize())
