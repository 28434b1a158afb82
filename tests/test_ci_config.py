"""CI enforces what the project claims: .ci/run runs the tests, ruff (lint and format) and mypy,
and fails when any of them fails; pytest runs strict (unknown markers, passing xfails and
warnings are errors); every declared dependency is used."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHECKS = ["-m pytest", "-m ruff check .", "-m ruff format --check .", "-m mypy"]

TEST_TOOLS = {
    "pytest": "the test runner",
    "pytest-asyncio": "asyncio_mode in [tool.pytest.ini_options]",
    "pytest-timeout": "timeout in [tool.pytest.ini_options]",
    "pytest-xdist": "-n 2 in [tool.pytest.ini_options] addopts",
    "ruff": ".ci/run",
    "mypy": ".ci/run",
    "accelerate": "transformers loads a GGUF model only with it installed",
    "lm-eval": "run as a process (`python -m lm_eval`) by tests/api/openai/test_lm_eval.py",
    "vllm-router": "run as a process (`python -m vllm_router.launch_router`) by tests/routing",
    "nixl": "imported by the package (kv_transfer/agent.py) where --kv-transfer nixl asks for it",
}
"""Test-extra packages no test imports, and why they are there."""


def _fake_bin(tmp_path: Path) -> Path:
    """`python3` and `deepinfer` stand-ins that log each call and fail when it matches $FAIL."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "deepinfer"):
        tool = bin_dir / name
        tool.write_text(
            "#!/usr/bin/env bash\n"
            'echo "$*" >> "$CALLS"\n'
            'if [ -n "${FAIL:-}" ] && [[ "$*" == *"$FAIL"* ]]; then exit 1; fi\n'
        )
        tool.chmod(0o755)
    return bin_dir


def _run_ci(tmp_path: Path, fail: str) -> tuple[int, list[str], str]:
    """Run .ci/run with every command it runs faked; returns (exit status, calls, stderr)."""
    calls = tmp_path / "calls.txt"
    path = f"{_fake_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "CALLS": str(calls), "FAIL": fail}
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60,
        check=False,
    )  # fmt: skip
    return proc.returncode, calls.read_text().splitlines(), proc.stderr


@pytest.mark.parametrize("fail", ["", *CHECKS])
def test_ci_runs_every_check_and_fails_on_any(tmp_path: Path, fail: str) -> None:
    returncode, calls, stderr = _run_ci(tmp_path, fail)
    for check in CHECKS:
        assert any(call.startswith(check) for call in calls), f"{check!r} never ran: {calls}"
    if fail:
        assert returncode != 0, f"CI passed although {fail!r} failed"
        assert "CI failed" in stderr
    else:
        assert returncode == 0, stderr


def test_pytest_is_strict() -> None:
    ini = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in ini["addopts"].split()
    assert ini["xfail_strict"] is True
    assert ini["filterwarnings"][0] == "error"
    assert all(f.startswith("ignore:") for f in ini["filterwarnings"][1:])


@pytest.mark.slow
def test_strictness_is_what_pytest_applies(tmp_path: Path) -> None:
    """A warning of deepinfer's code or of a third party's and a passing xfail fail; an unknown
    marker is an error, under this config."""
    (tmp_path / "test_warns.py").write_text(
        "import warnings\n\nimport pytest\n\n\n"
        "def test_warns():\n    warnings.warn_explicit('ours', UserWarning, 'deepinfer/probe.py', 1,"
        " module='deepinfer.probe')\n\n\n"
        "def test_warns_elsewhere():\n    warnings.warn_explicit('theirs', DeprecationWarning,"
        " 'somelib/x.py', 1, module='somelib.x')\n\n\n"
        "@pytest.mark.xfail(reason='expected to fail')\ndef test_passes():\n    pass\n"
    )
    (tmp_path / "test_marker.py").write_text(
        "import pytest\n\n\n@pytest.mark.no_such_marker\ndef test_marked():\n    pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "--continue-on-collection-errors", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1]
    assert "3 failed" in summary and "1 error" in summary and "passed" not in summary, summary


def _imported_names(*paths: Path) -> set[str]:
    names: set[str] = set()
    for path in paths:
        files = [path] if path.is_file() else path.rglob("*.py")
        for file in files:
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
                elif _is_importorskip(node):
                    names.add(node.args[0].value.split(".")[0])
    return names


def _is_importorskip(node: ast.AST) -> bool:
    """`pytest.importorskip("name", ...)`, the tests' other way to import."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "importorskip"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _distributions(import_names: set[str]) -> set[str]:
    by_module = importlib.metadata.packages_distributions()
    return {canonicalize_name(d) for n in import_names for d in by_module.get(n, [])}


def _declared(requirements: list[str]) -> set[str]:
    reqs = [Requirement(r) for r in requirements]
    return {canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate()}


@pytest.mark.slow
def test_every_dependency_is_imported_by_the_package() -> None:
    used = _distributions(_imported_names(ROOT / "deepinfer", ROOT / "kernels", ROOT / "server.py"))
    assert _declared(PYPROJECT["project"]["dependencies"]) - used == set()


def test_every_test_dependency_is_used() -> None:
    used = _distributions(_imported_names(ROOT / "tests", ROOT / "bench"))
    unused = _declared(PYPROJECT["project"]["optional-dependencies"]["test"]) - used
    assert unused - set(TEST_TOOLS) == set()
    assert "ruff" in (ROOT / ".ci" / "run").read_text()
