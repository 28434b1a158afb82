"""What the Triton kernel modules share: `triton`, `tl`, the `jit` decorator and the `dot` helper.

Only the Triton kernel modules (`kv_store`, `norm`, `rotary`, `matmul`, `moe_grouped`,
`paged_attention_kernels` and, through it, `paged_attention`) import this module, so Triton is loaded only when a Triton
kernel is used; the CPU path's modules (`dispatch`, the `*_torch` references, the native CPU
kernels) never import it. Without Triton this module still imports: `jit` returns functions
unchanged (never launched, since `dispatch.triton_available` answers False).

Triton chooses interpreter or compiler per `@jit` function when it is defined, so
`TRITON_INTERPRET=1` must be set before this module is first imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is installed wherever the tests run
    triton = None
    tl = None


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when Triton is installed, else the function unchanged (it is never launched)."""
    return triton.jit(fn) if triton is not None else fn


@jit
def dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b. UPCAST (set for the interpreter only) works around its broken bf16 dot, and
    multiplies in float64 (the products exact, the sum's rounding far below float32's) so that a
    row's result does not depend on where it sits in the tile: the interpreter's dot is numpy's
    BLAS, whose float32 kernels sum a tile's edge rows in another order than its inner ones."""
    if UPCAST:
        exact = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")
        return acc + exact.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)
