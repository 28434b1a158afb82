"""Building and loading the native CPU kernels: cached builds, clear refusals, the switch-off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.kernels.native.cpu_native import (
    NativeUnavailableError,
    build,
    cpu_flags,
    native_available,
)
from deepinfer.model.attention import select_attention_backend

needs_native = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")


@pytest.mark.slow
@needs_native
def test_a_build_is_reused(tmp_path: Path) -> None:
    first = build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_no_compiler_is_a_clear_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(NativeUnavailableError, match=r"no C compiler|lacks|x86-64"):
        build(tmp_path / "x")


def test_cpu_flags_are_read() -> None:
    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    if Path("/proc/cpuinfo").exists():
        assert flags  # Linux lists at least some flags


@needs_native
def test_auto_picks_the_cpu_backend_and_refuses_it_elsewhere() -> None:
    assert select_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert select_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ConfigError, match="runs on CPU"):
        select_attention_backend("cpu", torch.device("cuda"))


@pytest.mark.slow
def test_switched_off_by_the_environment() -> None:
    code = (
        "import torch\n"
        "from deepinfer.kernels.native.cpu_native import native_available\n"
        "from deepinfer.model.attention import select_attention_backend\n"
        "assert not native_available()\n"
        "print(select_attention_backend('auto', torch.device('cpu')).name)\n"
    )
    env = {"DEEPINFER_NATIVE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "torch"
