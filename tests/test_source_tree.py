"""`deepinfer.kernels` comes from this checkout's kernels/ whatever else is installed, and the
finder that makes it so stays out of installed wheels and of every other name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import deepinfer.kernels
from deepinfer import source_tree

ROOT = Path(__file__).resolve().parents[1]


def test_checkout_kernels_win_over_the_installed_ones() -> None:
    assert source_tree.is_checkout()
    assert sum(isinstance(f, source_tree.SourceKernelsFinder) for f in sys.meta_path) == 1
    assert [Path(p).resolve() for p in deepinfer.kernels.__path__] == [ROOT / "kernels"]


def test_finder_maps_one_name_only() -> None:
    finder = source_tree.SourceKernelsFinder()
    spec = finder.find_spec("deepinfer.kernels", None)
    assert spec is not None and spec.loader is None  # a namespace package: no __init__.py
    assert spec.submodule_search_locations == [str(ROOT / "kernels")]
    for name in ("kernels", "deepinfer", "deepinfer.kernels.dispatch", "deepinfer.model"):
        assert finder.find_spec(name, None) is None


def test_install_is_idempotent() -> None:
    source_tree.install()
    assert sum(isinstance(f, source_tree.SourceKernelsFinder) for f in sys.meta_path) == 1


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["pyproject.toml", "kernels/dispatch.py"], True),
        (["pyproject.toml", "kernels/dispatch.py", "deepinfer/kernels/dispatch.py"], False),
        (["kernels/dispatch.py"], False),  # site-packages: another distribution's `kernels`
        (["pyproject.toml", "kernels/__init__.py"], False),  # a `kernels` package, not ours
        (["pyproject.toml"], False),
    ],
)
def test_only_a_checkout_gets_the_finder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: list[str], expected: bool
) -> None:
    for name in ["deepinfer/__init__.py", *files]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    monkeypatch.setattr(source_tree, "PACKAGE_DIR", tmp_path / "deepinfer")
    monkeypatch.setattr(source_tree, "KERNELS_DIR", tmp_path / "kernels")
    assert source_tree.is_checkout() is expected
