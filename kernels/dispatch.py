"""Choosing between a Triton kernel and its torch reference, and the launchers' shared checks.

Two kinds of launcher error, kept apart on purpose:
- `KernelUnsupportedError`: the input is valid but this kernel does not cover it (no Triton
  backend for the device, a head dim it was not written for). The caller falls back to the
  torch reference; `run_or_fallback` does that and logs one line per (kernel, reason).
- `KernelInputError`: the input is wrong (mismatched shapes, a wrong dtype). Falling back would
  only hide the bug, so it propagates.

This module never imports Triton (the CPU path imports it): `triton_available` only looks the
package up. The Triton kernel modules get `triton`, `jit` and `dot` from `triton_common`, and are
imported only where a Triton kernel is used.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
"""Whether the triton package is installed (looked up, not imported)."""

logger = logging.getLogger("deepinfer.kernels")

R = TypeVar("R")

_logged_fallbacks: set[tuple[str, str]] = set()


class KernelUnsupportedError(ValueError):
    """Valid input this kernel does not cover; the caller should use the torch reference."""


class KernelInputError(ValueError):
    """Invalid input to a launcher (shape, dtype, device or stride mismatch)."""


def triton_available(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device`.

    CUDA needs compute capability >= 7.0; CPU tensors need `TRITON_INTERPRET=1` (the interpreter,
    used by the tests), which must be set before the Triton kernel modules are imported.
    """
    if not HAS_TRITON:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device) >= (7, 0)
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return False


def is_interpreted(kernel: object) -> bool:
    """Whether a `@jit` function was built for the Triton interpreter (decided at its import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def require_backend(device: torch.device, kernel: object) -> None:
    """Raises KernelUnsupportedError unless `kernel` can be launched on `device`."""
    if not triton_available(device):
        raise KernelUnsupportedError(f"no Triton backend for device {device}")
    if device.type == "cpu" and not is_interpreted(kernel):
        raise KernelUnsupportedError(
            "TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it before"
        )


def check(condition: bool, message: str) -> None:
    """Raises KernelInputError(message) unless `condition` holds."""
    if not condition:
        raise KernelInputError(message)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> None:
    """Checks rank, dtype, device and (by default) a unit stride in the last dimension."""
    check(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor")
    check(tensor.dim() == ndim, f"{name} must have {ndim} dimensions, got {tuple(tensor.shape)}")
    allowed = tuple(dtypes)
    check(tensor.dtype in allowed, f"{name} must have dtype in {allowed}, got {tensor.dtype}")
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    if last_dim_contiguous and tensor.shape[-1] > 1:
        check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension")


def output_buffer(
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """`out` checked against (shape, dtype, device, unit last stride), or a new empty tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, len(shape), (dtype,), device, last_dim_contiguous)
    check(tuple(out.shape) == shape, f"{name} must have shape {shape}, got {tuple(out.shape)}")
    return out


def check_head_dim(head_dim: int) -> None:
    """The attention kernels cover power-of-two head dims in [16, 256]."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise KernelUnsupportedError(f"head_dim {head_dim} is not a power of two in [16, 256]")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact ("ieee") dots; tf32 would break the fp32 tolerance."""
    return "ieee" if dtype == torch.float32 else "tf32"


def run_or_fallback(
    name: str,
    kernel: Callable[..., R],
    reference: Callable[..., R],
    *args: Any,
    **kwargs: Any,
) -> R:
    """Runs `kernel`, or `reference` when the kernel raises KernelUnsupportedError.

    Each distinct (name, reason) is logged once, so a fallback is visible but never floods the log.
    `kwargs` go to both functions; pass kernel-only options through a closure.
    """
    try:
        return kernel(*args, **kwargs)
    except KernelUnsupportedError as exc:
        key = (name, str(exc))
        if key not in _logged_fallbacks:
            _logged_fallbacks.add(key)
            logger.warning("kernel %s falls back to torch: %s", name, exc)
        return reference(*args, **kwargs)
