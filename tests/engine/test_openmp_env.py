"""`deepinfer.openmp_env`: OpenMP's wait policy is set before torch loads libgomp, never over
the user's own settings, and a process that loaded libgomp first is told so.

The processes are fresh interpreters: what matters is the order of imports at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.openmp_env import DEFAULTS, apply_defaults, libgomp_loaded

PROBE = """
import json, os, sys
first = sys.argv[1]
if first == "torch":
    import torch
import deepinfer
from deepinfer.openmp_env import loaded_too_late
import torch
maps = open("/proc/self/maps").read()
print(json.dumps({
    "too_late": loaded_too_late(),
    "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
    "libgomp": "libgomp" in maps,
}))
"""


def _probe(first: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in DEFAULTS}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, first],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_deepinfer_first_sets_the_policy_before_libgomp_loads() -> None:
    got = _probe("deepinfer")
    assert got["libgomp"], "torch loads libgomp: the probe checks the right library"
    assert got["env"] == dict(DEFAULTS)
    assert got["too_late"] is False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_torch_first_is_reported_too_late() -> None:
    got = _probe("torch")
    assert got["too_late"] is True
    assert got["env"] == dict(DEFAULTS)  # children started from here still get them


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_user_settings_win_and_are_never_too_late() -> None:
    got = _probe("torch", OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="10")
    assert got["env"] == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10"}
    assert got["too_late"] is False  # the user chose; nothing of ours was missing


def test_apply_defaults_fills_only_what_is_missing() -> None:
    env = {"OMP_WAIT_POLICY": "passive"}
    apply_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": DEFAULTS["GOMP_SPINCOUNT"]}
    complete = dict(DEFAULTS)
    assert apply_defaults(complete) is True and complete == dict(DEFAULTS)


def test_libgomp_loaded_reads_the_memory_map(tmp_path: Path) -> None:
    with_gomp = tmp_path / "maps1"
    with_gomp.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1\n")
    without = tmp_path / "maps2"
    without.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert libgomp_loaded(str(with_gomp)) is True
    assert libgomp_loaded(str(without)) is False
