"""The int8-activation matmul (kernels/cpu/int8_gemm.c, int8_kquants.c) against its arithmetic
computed in float64 by torch, and against the exact float product within the rounding of x, for
every format."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer.kernels.linear.int8_matmul import (
    Int8PackedWeight,
    block_linear,
    int8_error_bound,
    int8_linear,
    int8_linear_reference,
    pack_int8,
    pack_int8_rows,
    packed_bytes,
    quantize_activations,
)
from deepinfer.kernels.linear.quant_matmul import (
    QuantFormat,
    QuantizedWeight,
    quant_linear_reference,
)
from deepinfer.kernels.native.cpu_native import native_library
from tests.kernels.gguf_weights import K_QUANTS, gguf_weight, kquant_blocks, needs_native, width


def _weight(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantizedWeight:
    return gguf_weight(fmt, n, k, seed)[0]


def _raw_weight(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantizedWeight:
    """Every byte random but the scales: all nibbles, and Q8_0's -128, which gguf-py never
    writes but a file may hold (K-quants: every scale, min and quant)."""
    if fmt in K_QUANTS:
        return QuantizedWeight(fmt, torch.from_numpy(kquant_blocks(fmt, n, k, seed)), k)
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, nb, generator=gen).half().view(torch.uint8).view(n, nb, 2)
    blocks[..., 0:2] = scale
    if fmt is QuantFormat.Q4_1:
        blocks[..., 2:4] = (-scale.view(torch.float16) * 7).view(torch.uint8).view(n, nb, 2)
    return QuantizedWeight(fmt, blocks.reshape(n, -1).contiguous(), k)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 sums of float32-scaled integer blocks: a few ulps of the largest term."""
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=2e-6 * max(scale, 1.0), rtol=1e-5)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 9, 32, 33, 70])
def test_int8_linear_matches_its_arithmetic_in_float64(fmt: QuantFormat, m: int) -> None:
    k = width(fmt, 3)
    w = _weight(fmt, 37, k, seed=m)  # 37 rows: the last group of 8 is partial
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    _close(int8_linear(x, pack_int8(w)), int8_linear_reference(x, w))


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_every_byte_value_and_extreme_activations(fmt: QuantFormat) -> None:
    k = width(fmt, 4)
    w = _raw_weight(fmt, 24, k, seed=3)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[1, 32:64] = torch.where(torch.arange(32) % 2 == 0, 1e4, -1e4)  # every entry +-127
    x[2, 64:96] = 1e-30  # tiny but not zero
    x[3] = x[3] * 1e6
    _close(int8_linear(x, pack_int8(w)), int8_linear_reference(x, w))


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_int8_error_stays_within_the_rounding_of_x(fmt: QuantFormat) -> None:
    w = _weight(fmt, 64, 512, seed=11)  # two K-quant superblocks, 16 blocks of 32
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(11))
    got = int8_linear(x, pack_int8(w))
    exact = quant_linear_reference(x, w)
    bound = int8_error_bound(x, w)
    assert ((got - exact).abs() <= bound + 1e-4).all()
    assert (got - exact).abs().max() > 0  # x really was rounded


def test_quantize_activations_rounds_to_the_nearest_step() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    q, dx = quantize_activations(x)
    assert q.abs().amax(-1).eq(127).all()  # each block's largest entry maps to +-127
    assert ((q * dx).reshape(3, 64) - x).abs().le(dx.expand(-1, -1, 32).reshape(3, 64) / 2).all()


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_rows_and_threads_do_not_change_results(fmt: QuantFormat) -> None:
    k = width(fmt, 2)
    w = pack_int8(_weight(fmt, 40, k, seed=4))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    together = int8_linear(x, w)
    for m in range(11):
        assert torch.equal(int8_linear(x[m : m + 1], w), together[m : m + 1])
    assert torch.equal(int8_linear(x[3:10], w), together[3:10])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, together)


@needs_native
def test_block_linear_dispatches_on_the_weight() -> None:
    w = _weight(QuantFormat.Q4_1, 16, 64, seed=5)
    packed = pack_int8(w)
    x = torch.randn(2, 64)
    # 2 groups of 8 rows x 2 blocks x 160 bytes: as many as the GGUF blocks (float16 scales kept)
    assert packed.nbytes == packed_bytes(QuantFormat.Q4_1, 16, 64) == 2 * 2 * 160
    assert packed.nbytes == w.blocks.numel()
    assert torch.equal(block_linear(x, packed), int8_linear(x, packed))
    torch.testing.assert_close(block_linear(x, w), quant_linear_reference(x, w))


@needs_native
def test_bad_inputs_are_refused() -> None:
    w = pack_int8(_weight(QuantFormat.Q4_1, 8, 64, seed=6))
    with pytest.raises(ValueError, match="float32 CPU"):
        int8_linear(torch.zeros(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="cannot multiply"):
        int8_linear(torch.zeros(2, 32), w)
    short = Int8PackedWeight(QuantFormat.Q4_1, w.packed, 8, 0)
    with pytest.raises(ValueError, match="rejected"):
        int8_linear(torch.zeros(1, 0), short)


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_vnni_and_avx2_passes_give_the_same_bits(fmt: QuantFormat) -> None:
    """AVX-512 VNNI passes (8 rows of x a pass over the weights) against the AVX2 ones (4): the
    integer sums are exact both ways and the float steps the same, so every bit agrees, for
    each row count's split into passes and every byte value of the weights."""
    lib = native_library()
    if lib.int8_isa(1) != 1:
        pytest.skip("this CPU has no AVX-512 VNNI")
    k = width(fmt, 5 if fmt not in K_QUANTS else 2)
    w = pack_int8(_raw_weight(fmt, 45, k, seed=8))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(8)) * 2
    x[2, :32] = 0.0
    x[5, 32:64] = torch.where(torch.arange(32) % 2 == 0, 1e4, -1e4)
    try:
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 19):
            vnni = int8_linear(x[:m], w)
            assert lib.int8_isa(0) == 0
            avx2 = int8_linear(x[:m], w)
            assert lib.int8_isa(1) == 1
            assert torch.equal(vnni, avx2), f"{m} rows"
    finally:
        lib.int8_isa(1)


@needs_native
@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("n", [40, 45, 64])
def test_two_group_passes_give_the_same_bits(fmt: QuantFormat, n: int) -> None:
    """The 512-bit passes over two groups of rows at once (the K-quants) against one group at a
    time: lane for lane the same operations, so every bit agrees, whatever the rows of x and
    however the groups fall (an odd count, a partial last group), on one thread and two."""
    lib = native_library()
    if lib.int8_isa(1) != 1:
        pytest.skip("this CPU has no AVX-512 VNNI")
    k = width(fmt, 2)
    w = pack_int8(_raw_weight(fmt, n, k, seed=n))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(n)) * 2
    threads = torch.get_num_threads()
    try:
        for m in (1, 2, 7, 8, 9, 17, 19):
            for t in (1, 2):
                torch.set_num_threads(t)
                assert lib.int8_pairs(1) == 1
                pairs = int8_linear(x[:m], w)
                assert lib.int8_pairs(0) == 0
                single = int8_linear(x[:m], w)
                assert torch.equal(pairs, single), f"{m} rows, {t} threads"
        _close(
            pairs, int8_linear_reference(x[:m], QuantizedWeight.cat([_raw_weight(fmt, n, k, n)]))
        )
    finally:
        lib.int8_pairs(1)
        torch.set_num_threads(threads)


def _columns(w: QuantizedWeight, first: int, end: int) -> QuantizedWeight:
    """Columns [first, end) of `w`, cut in its blocks."""
    per, width_ = w.fmt.block_weights, w.fmt.block_bytes
    blocks = w.blocks[:, first // per * width_ : end // per * width_].contiguous()
    return QuantizedWeight(w.fmt, blocks, end - first)


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("n", [45, 64])
def test_products_over_slices_of_k_chained_give_one_products_bits(fmt: QuantFormat, n: int) -> None:
    """A weight cut into slices of K in its blocks (a tensor-parallel row cut: ranks of 1, 2
    and 3 blocks), each slice's product going on from the previous one's output, has the bits
    of the product over all of K: every output sums the blocks one after another, so chaining
    changes nothing, on every pass (VNNI and AVX2, one or two groups at a time), every row count
    and one or two threads."""
    lib = native_library()
    per = fmt.block_weights
    cuts = [0, per, 3 * per, 6 * per]
    w = _raw_weight(fmt, n, cuts[-1], seed=n + 3)
    slices = [pack_int8(_columns(w, a, b)) for a, b in itertools.pairwise(cuts)]
    whole = pack_int8(w)
    x = torch.randn(19, cuts[-1], generator=torch.Generator().manual_seed(n)) * 2
    x[3, per : 2 * per] = 0.0
    threads = torch.get_num_threads()
    try:
        for isa in (1, 0) if lib.int8_isa(1) == 1 else (0,):
            assert lib.int8_isa(isa) == isa
            for m, t in ((1, 1), (2, 2), (8, 2), (9, 1), (19, 2)):
                torch.set_num_threads(t)
                y = int8_linear(x[:m, : cuts[1]], slices[0])
                for (a, b), part in zip(itertools.pairwise(cuts[1:]), slices[1:], strict=True):
                    y = int8_linear(x[:m, a:b], part, going_on=y)
                assert torch.equal(y, int8_linear(x[:m], whole)), (isa, m, t)
        assert not torch.equal(
            int8_linear(x[:2, cuts[1] :], pack_int8(_columns(w, cuts[1], cuts[-1]))),
            int8_linear(x[:2], whole),
        )  # the first slice's sums count
        with pytest.raises(ValueError, match="goes on from"):
            int8_linear(x[:2, : cuts[1]], slices[0], going_on=torch.zeros(3, n))
    finally:
        lib.int8_isa(1)
        torch.set_num_threads(threads)


def _extreme_k_weight(fmt: QuantFormat, n: int, k: int) -> QuantizedWeight:
    """Every quant at its largest magnitude (Q4_K 15, Q5_K 31, Q6_K's q - 32 at -32): the
    integer sums' largest (16-bit on AVX2: 8 x 15 x 127, 8 x 31 x 127, 8 x 32 x 127)."""
    raw = kquant_blocks(fmt, n, k, seed=9).reshape(n, k // 256, fmt.block_bytes)
    if fmt is QuantFormat.Q6_K:
        raw[..., 0:192] = 0
    else:
        raw[..., 16:] = 0xFF  # Q5_K's fifth bits, then the nibbles
    return QuantizedWeight(fmt, torch.from_numpy(raw.reshape(n, -1)), k)


@needs_native
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_sums_at_their_largest(fmt: QuantFormat) -> None:
    lib = native_library()
    w = _extreme_k_weight(fmt, 16, 512)
    x = torch.ones(5, 512)  # every block of x at +127
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, :256] = -2.0
    want = int8_linear_reference(x, w)
    try:
        for isa in (1, 0) if lib.int8_isa(1) == 1 else (0,):  # VNNI where the CPU has it, AVX2
            assert lib.int8_isa(isa) == isa
            _close(int8_linear(x, pack_int8(w)), want)
    finally:
        lib.int8_isa(1)


@needs_native
@pytest.mark.parametrize(
    ("first", "second"),
    [(QuantFormat.Q4_K, QuantFormat.Q6_K), (QuantFormat.Q4_1, QuantFormat.Q8_0)],
)
@pytest.mark.parametrize("m", [1, 5, 17])
def test_parts_in_two_formats_pack_into_one_weight(
    first: QuantFormat, second: QuantFormat, m: int
) -> None:
    """A fused projection stored in two formats (Q4_K_M's Q4_K q and k beside a Q6_K v) is one
    packed weight: each part's outputs are that part's own product, to the bit, on one and two
    threads; a third run of formats, or unaligned parts in two, are refused."""
    k = 512
    q, kk, v = _weight(first, 24, k, 1), _weight(first, 16, k, 2), _weight(second, 19, k, 3)
    packed = pack_int8_rows([q, kk, v])
    assert (packed.fmt, packed.fmt2, packed.rows2, packed.out_features) == (first, second, 19, 59)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = torch.cat([int8_linear(x, pack_int8(p)) for p in (q, kk, v)], dim=1)
    assert torch.equal(int8_linear(x, packed), want)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(int8_linear(x, packed), want)
    finally:
        torch.set_num_threads(threads)
    _close(int8_linear(x, packed), torch.cat([int8_linear_reference(x, p) for p in (q, kk, v)], 1))
    with pytest.raises(ValueError, match="two runs"):
        pack_int8_rows([q, v, kk])
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int8_rows([_weight(first, 20, k, 4), v])
