"""triton_available, the unsupported/invalid split, and the logged fallback to torch."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.kernels import dispatch
from deepinfer.kernels.dispatch import (
    KernelInputError,
    KernelUnsupportedError,
    run_or_fallback,
    triton_available,
)
from deepinfer.kernels.elementwise.norm import rms_norm, rms_norm_reference


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_logged_fallbacks", set())


def test_error_kinds_are_value_errors() -> None:
    assert issubclass(KernelUnsupportedError, ValueError)
    assert issubclass(KernelInputError, ValueError)
    assert not issubclass(KernelInputError, KernelUnsupportedError)


def test_triton_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_available("cpu")
    assert not triton_available("meta")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available(torch.device("cpu"))


def test_kernel_runs_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reference(*args: object) -> torch.Tensor:
        raise AssertionError("the reference ran although the kernel is available")

    x, weight = torch.randn(3, 32), torch.rand(32)
    result = run_or_fallback("rms_norm", rms_norm, no_reference, x, weight, 1e-5)
    torch.testing.assert_close(result, rms_norm_reference(x, weight, 1e-5))


def test_fallback_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, weight = torch.randn(3, 32), torch.rand(32)
    with caplog.at_level(logging.WARNING, logger="deepinfer.kernels"):
        for _ in range(3):
            result = run_or_fallback("rms_norm", rms_norm, rms_norm_reference, x, weight, 1e-5)
            assert torch.equal(result, rms_norm_reference(x, weight, 1e-5))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "rms_norm falls back to torch" in messages[0]


def test_invalid_input_is_not_hidden_by_the_fallback() -> None:
    x = torch.randn(3, 32)
    with pytest.raises(KernelInputError):
        run_or_fallback("rms_norm", rms_norm, rms_norm_reference, x, torch.rand(16), 1e-5)
