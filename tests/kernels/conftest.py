"""Shared fixtures for the kernel tests: interpreter check, fresh seeds, dtype tolerances.

The Triton kernel tests run on CPU tensors through Triton's interpreter. On a GPU machine,
`DEEPINFER_TEST_DEVICE=cuda TRITON_INTERPRET=0` runs the same tests compiled for the GPU: every
tensor a test makes lands there (torch's default device), references included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from deepinfer.kernels.attention import kv_store as kv_store_module
from deepinfer.kernels.attention import paged_attention_kernels
from deepinfer.kernels.dispatch import HAS_TRITON, is_interpreted
from deepinfer.kernels.elementwise import norm, rotary
from deepinfer.kernels.linear import matmul

_KERNELS = (
    kv_store_module._store_kv_kernel,
    norm._rms_norm_kernel,
    rotary._rotary_kernel,
    matmul._matmul_kernel,
    paged_attention_kernels.decode_partition_kernel,
    paged_attention_kernels.decode_reduce_kernel,
    paged_attention_kernels.prefill_kernel,
)

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
"""(atol, rtol) against a float64 reference; bf16 allows for the interpreter truncating on casts."""


DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _kernel_device() -> Iterator[None]:
    """CPU tensors through the interpreter, or (DEEPINFER_TEST_DEVICE=cuda) compiled on the GPU."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1" or not all(map(is_interpreted, _KERNELS)):
            pytest.skip("kernels were imported without TRITON_INTERPRET=1; see tests/conftest.py")
        yield
        return
    if not torch.cuda.is_available():
        pytest.skip(f"DEEPINFER_TEST_DEVICE={DEVICE}, but no CUDA device is available")
    if any(map(is_interpreted, _KERNELS)):
        pytest.skip("kernels were imported for the interpreter: run with TRITON_INTERPRET=0")
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (DEEPINFER_TEST_SEED replays one); it is in every failure message."""
    value = int(os.environ.get("DEEPINFER_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(value)
    return value


@pytest.fixture
def assert_close(seed: int) -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """Compares a kernel output with a float64 reference at the tolerance of `dtype`."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(
            actual.double(),
            expected.double(),
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"{m}\n(seed {seed}; rerun with DEEPINFER_TEST_SEED={seed})",
        )

    return check
