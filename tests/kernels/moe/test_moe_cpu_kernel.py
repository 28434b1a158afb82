"""The one-call native experts (`cpu/moe_experts.c`) against the Python path it replaces, three
calls a run (`block_linear`, `silu_mul`, `block_linear`): bit-identical, for float and int8
activations, any runs (experts repeated, skipped, empty), any thread count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.elementwise.elementwise_cpu import silu_mul_cpu
from deepinfer.kernels.linear.int8_matmul import block_linear, pack_int8
from deepinfer.kernels.linear.quant_matmul import QuantFormat
from deepinfer.kernels.moe.moe_cpu import NativeExperts
from deepinfer.kernels.moe.moe_torch import run_each
from deepinfer.kernels.native.cpu_native import NativeUnavailableError, native_library
from tests.kernels.gguf_weights import gguf_weight

try:
    native_library()
except NativeUnavailableError as exc:  # pragma: no cover - machines without AVX2 or a compiler
    pytest.skip(f"native kernels unavailable: {exc}", allow_module_level=True)

E, D, W = 6, 256, 256  # experts, hidden, width (K-quants take whole 256-blocks)


def _experts(fmt: QuantFormat, int8: bool) -> tuple[list, list]:
    gate_up = [gguf_weight(fmt, 2 * W, D, seed=e)[0] for e in range(E)]
    down = [gguf_weight(fmt, D, W, seed=100 + e)[0] for e in range(E)]
    if int8:
        gate_up, down = [pack_int8(w) for w in gate_up], [pack_int8(w) for w in down]
    return gate_up, down


WEIGHTS = {
    (fmt, int8): _experts(fmt, int8)
    for fmt in (QuantFormat.Q8_0, QuantFormat.Q4_K)
    for int8 in (False, True)
}


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(sorted(WEIGHTS, key=str)),
    st.lists(st.tuples(st.integers(0, E - 1), st.integers(0, 9)), max_size=8),
    st.integers(1, 2),
)
def test_native_experts_equal_three_calls_a_run(
    key: tuple[QuantFormat, bool], runs: list[tuple[int, int]], threads: int
) -> None:
    gate_up, down = WEIGHTS[key]
    rows = torch.randn(sum(n for _, n in runs), D)

    def ffn(expert: int, x: torch.Tensor) -> torch.Tensor:
        return block_linear(silu_mul_cpu(block_linear(x, gate_up[expert])), down[expert])

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = run_each(ffn)(rows, runs)
        got = NativeExperts(gate_up, down).run(rows, runs)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, want)


def test_runs_must_cover_the_rows() -> None:
    gate_up, down = WEIGHTS[(QuantFormat.Q8_0, False)]
    with pytest.raises(ValueError, match="runs of 3 rows for 4"):
        NativeExperts(gate_up, down).run(torch.randn(4, D), [(0, 3)])
