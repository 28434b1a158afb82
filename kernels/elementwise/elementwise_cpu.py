"""RMSNorm, residual add + RMSNorm, rotary embedding, the KV store and the MLP's silu(gate) * up
and gelu_tanh(gate) * up for the `cpu` backend, through the native kernels
(`cpu/elementwise.c`): one pass over each row instead of torch's several ops and temporaries
(about 20 ms of a 32-stream decode step on two cores).

Same signatures as the references in `norm_torch`, `rotary_torch`, `kv_store_torch` and
`activation`, which they call wherever the native path does not apply: not float32 on CPU, rows
not laid out as the kernel reads them, or no native library here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention.kv_store_torch import store_kv_reference
from ..native.cpu_abi import RmsNormArgs
from ..native.cpu_native import native_available, native_library
from .activation import gelu_tanh_mul_reference, silu_mul_reference
from .norm_torch import fused_add_rms_norm_reference, rms_norm_reference
from .rotary_torch import apply_rotary_reference

_KV_DTYPES = (torch.float32, torch.float16)


def _rows(x: torch.Tensor) -> bool:
    """float32 CPU rows of unit-stride, 8-aligned width (any row stride)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] % 8 == 0
        and native_available()
    )


def _norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()


def _native_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x (+ residual)) * weight, x + residual or None) through `di_rms_norm`."""
    out = torch.empty(x.shape, dtype=torch.float32)
    args = RmsNormArgs(
        x=x.data_ptr(), x_stride=x.stride(0), w=weight.data_ptr(), out=out.data_ptr(),
        out_stride=out.stride(0), T=x.shape[0], D=x.shape[1], eps=eps,
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    summed = None
    if residual is not None:
        summed = torch.empty(x.shape, dtype=torch.float32)
        args.residual, args.residual_stride = residual.data_ptr(), residual.stride(0)
        args.summed, args.summed_stride = summed.data_ptr(), summed.stride(0)
    native_library().rms_norm(args)
    return out, summed


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dimension; [T, H, D] (per-head q/k norms) runs as T * H rows of D."""
    if x.dim() == 3 and x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[2])  # a copy unless the heads are rows of one stride
        return rms_norm_cpu(rows, weight, eps).view(x.shape)
    if not _norm_applies(x, weight):
        return rms_norm_reference(x, weight, eps)
    return _native_norm(x, None, weight, eps)[0]


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if not (_norm_applies(x, weight) and _rows(residual) and x.shape == residual.shape):
        return fused_add_rms_norm_reference(x, residual, weight, eps)
    out, summed = _native_norm(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def _heads(x: torch.Tensor) -> bool:
    """float32 CPU [T, H, D] with each token's heads contiguous (any token stride)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
    )


def apply_rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    applies = (
        _heads(q)
        and _heads(k)
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] == cos_sin.shape[1]
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin.dtype == torch.float32
        and cos_sin.is_contiguous()
        and native_available()
    )
    if not applies:
        apply_rotary_reference(q, k, positions, cos_sin)
        return
    native_library().rotary(
        q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
        positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0], q.shape[0], q.shape[2],
        torch.get_num_threads(),
    )  # fmt: skip


def store_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    applies = (
        _heads(k)
        and _heads(v)
        and k.shape == v.shape
        and k_cache.dtype in _KV_DTYPES
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == k.shape[1:]
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and native_available()
    )
    if not applies:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    native_library().store_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), num_slots, slot_mapping.data_ptr(), k.shape[0],
        k.shape[1] * k.shape[2], int(k_cache.dtype == torch.float16),
    )  # fmt: skip


def _gated_mul(
    gate_up: torch.Tensor, kernel: Callable[..., None]
) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """act(gate) * up through one of the library's gated kernels (the caller has checked
    `_gated_applies`)."""
    tokens, half = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, half), dtype=torch.float32)
    kernel(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), tokens, half,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _gated_applies(gate_up: torch.Tensor) -> bool:
    return _rows(gate_up) and gate_up.shape[1] % 16 == 0


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if not _gated_applies(gate_up):
        return silu_mul_reference(gate_up)
    return _gated_mul(gate_up, native_library().silu_mul)


def gelu_tanh_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """gelu_tanh(gate) * up within a few float32 ulps of |gate * up| of torch's (see
    `gelu_tanh8` in cpu/elementwise.c: the kernel's is closer to the exact value)."""
    if not _gated_applies(gate_up):
        return gelu_tanh_mul_reference(gate_up)
    return _gated_mul(gate_up, native_library().gelu_tanh_mul)
