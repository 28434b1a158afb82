"""The `cpu` backend's native norm, rotary, KV-store, silu * up and gelu_tanh * up kernels
(kernels/cpu/elementwise.c) against the torch references they replace, on the strided views a
forward pass gives them."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.attention.kv_store import store_kv_reference
from deepinfer.kernels.elementwise import elementwise_cpu as ew
from deepinfer.kernels.elementwise.activation import gelu_tanh_mul_reference, silu_mul_reference
from deepinfer.kernels.elementwise.norm import fused_add_rms_norm_reference, rms_norm_reference
from deepinfer.kernels.elementwise.rotary import apply_rotary_reference, rotary_cos_sin
from deepinfer.kernels.native.cpu_native import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")
H, HKV, D = 9, 3, 64


def _qkv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D]: views of one fused projection, as the model has."""
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=torch.Generator().manual_seed(seed))
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    return q.view(t, H, D), k.view(t, HKV, D), v.view(t, HKV, D)


@pytest.mark.parametrize("t", [0, 1, 7, 300])  # 300 rows: split over threads
def test_norms_match_the_reference(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x, residual = torch.randn(t, 576, generator=gen), torch.randn(t, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    out, summed = ew.fused_add_rms_norm_cpu(x, residual, w, 1e-5)
    want_out, want_summed = fused_add_rms_norm_reference(x, residual, w, 1e-5)
    assert torch.equal(summed, want_summed)  # one rounding, the same
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)  # the sum's order differs
    torch.testing.assert_close(ew.rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))


def test_norm_reads_strided_rows() -> None:
    wide = torch.randn(5, 1024)
    x = wide[:, 128:704]  # row stride 1024
    w = torch.randn(576)
    torch.testing.assert_close(ew.rms_norm_cpu(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_per_head_norm_is_the_norm_of_every_head() -> None:
    """q [T, H, D], a view of the fused projection (q/k norms): the rows of the 2-D kernel."""
    q, _, _ = _qkv(5, seed=2)
    w = torch.randn(D)
    got = ew.rms_norm_cpu(q, w, 1e-6)
    assert got.shape == q.shape
    assert torch.equal(got, ew.rms_norm_cpu(q.reshape(-1, D).clone(), w, 1e-6).view(q.shape))
    torch.testing.assert_close(got, rms_norm_reference(q, w, 1e-6), rtol=1e-6, atol=1e-6)
    one = _qkv(1, seed=2)[0]  # one token: its heads are rows of one stride, no copy
    assert torch.equal(ew.rms_norm_cpu(one, w, 1e-6)[0], ew.rms_norm_cpu(one[0], w, 1e-6))


@pytest.mark.parametrize("t", [1, 6, 200])
def test_rotary_matches_the_reference(t: int) -> None:
    q, k, _ = _qkv(t, seed=t)
    q_ref, k_ref = q.clone(), k.clone()
    cos_sin = rotary_cos_sin(D, 4096, 100000.0)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(t))
    ew.apply_rotary_cpu(q, k, positions, cos_sin)
    apply_rotary_reference(q_ref, k_ref, positions, cos_sin)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)


def test_rotary_refuses_positions_past_the_table() -> None:
    q, k, _ = _qkv(2, seed=0)
    with pytest.raises(ValueError, match="rejected"):
        ew.apply_rotary_cpu(q, k, torch.tensor([0, 64]), rotary_cos_sin(D, 64, 10000.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    _, k, v = _qkv(9, seed=3)
    caches = [torch.full((12, 16, HKV, D), 7.0, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(12 * 16, generator=torch.Generator().manual_seed(3))[:9]
    slots[4] = -1  # padding: skipped
    ew.store_kv_cpu(k, v, caches[0], caches[1], slots)
    store_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="rejected"):
        ew.store_kv_cpu(k, v, caches[0], caches[1], torch.full((9,), 12 * 16))


def test_other_layouts_fall_back_to_the_reference() -> None:
    x = torch.randn(3, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    assert torch.equal(ew.rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    narrow = torch.randn(3, 12)  # not a multiple of 8 wide
    assert torch.equal(
        ew.rms_norm_cpu(narrow, torch.ones(12), 1e-5),
        rms_norm_reference(narrow, torch.ones(12), 1e-5),
    )
    _, k, v = _qkv(4, seed=5)
    caches = [torch.zeros(4, 4, HKV, D, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.arange(4)
    ew.store_kv_cpu(k, v, caches[0], caches[1], slots)
    store_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("t", [1, 5, 64])  # 64 x 1536: split over threads
def test_silu_mul_matches_the_reference(t: int) -> None:
    gate_up = torch.randn(t, 2 * 1536, generator=torch.Generator().manual_seed(t)) * 8
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    got = ew.silu_mul_cpu(gate_up)
    assert got.shape == (t, 1536)
    # exp within 2 ulp: a few float32 ulps of the product
    torch.testing.assert_close(got, silu_mul_reference(gate_up), rtol=1e-6, atol=1e-30)


def test_silu_mul_reads_strided_rows_and_falls_back_elsewhere() -> None:
    wide = torch.randn(3, 200)
    view = wide[:, 4:196]  # 192 wide, row stride 200
    torch.testing.assert_close(ew.silu_mul_cpu(view), silu_mul_reference(view), rtol=1e-6, atol=0)
    odd = torch.randn(3, 24)  # halves of 12: not the kernel's
    assert torch.equal(ew.silu_mul_cpu(odd), silu_mul_reference(odd))


def _gelu_gates() -> torch.Tensor:
    """Dense over [-12, 12] (where torch's tanh saturates to -1 and past it), and beyond."""
    dense = torch.linspace(-12.0, 12.0, 48_000)
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 88.0, -88.0, 1e3, -1e3])
    huge = torch.tensor([1e10, -1e10, 1e20, -1e20, 3e38, -3e38])  # x^3 overflows
    wide = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 30
    return torch.cat([dense, edges, huge, wide])  # 48_032 = 2 x 24_016: whole 8-lane rows


@pytest.mark.parametrize("t", [1, 2])  # 2 x 24016: split over threads
def test_gelu_tanh_mul_matches_the_reference(t: int) -> None:
    gate = _gelu_gates().view(t, -1)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(t)) * 4
    gate_up = torch.cat([gate, up], dim=1)
    got, want = ew.gelu_tanh_mul_cpu(gate_up), gelu_tanh_mul_reference(gate_up)
    assert got.shape == gate.shape
    # torch's 1 + tanh(y) cancels for negative gates (its own error reaches ~2 ulps of the
    # gate): the two agree within a few ulps of |gate * up|, and within 1e-6 where they cannot
    # cancel
    scale = (gate * up).abs().double() * 2.0**-24
    close = (got.double() - want.double()).abs() <= 4 * scale
    assert (close | (got == want)).all()  # equal: the products that overflow, to -inf alike
    positive = gate > 0
    torch.testing.assert_close(got[positive], want[positive], rtol=1e-6, atol=0)
    exact = gate.double() * torch.special.expit(  # gelu_tanh(x) = x * sigmoid(2 y)
        2 * (2 / torch.pi) ** 0.5 * (gate.double() + 0.044715 * gate.double() ** 3)
    )
    # each ulp of rounding in exp's argument (up to 11 at |gate| = 4) moves the result by ~|arg|
    # ulps: within 2e-6 where the result is above ~1e-4 of the gate
    small = gate.abs() < 4
    torch.testing.assert_close(
        got[small].double(), (exact * up.double())[small], rtol=2e-6, atol=1e-30
    )
    assert torch.equal(got[gate < -11], want[gate < -11])  # both -0 (or +0 for up < 0)


def test_gelu_tanh_mul_reads_strided_rows_and_falls_back_elsewhere() -> None:
    wide = torch.randn(3, 200) * 3
    view = wide[:, 4:196]
    scale = (view[:, :96] * view[:, 96:]).abs() * 2.0**-24
    assert ((ew.gelu_tanh_mul_cpu(view) - gelu_tanh_mul_reference(view)).abs() <= 4 * scale).all()
    odd = torch.randn(3, 24)
    assert torch.equal(ew.gelu_tanh_mul_cpu(odd), gelu_tanh_mul_reference(odd))
