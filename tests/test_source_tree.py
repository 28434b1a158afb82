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
    assert deepinfer.kernels.__file__ is not None
    assert Path(deepinfer.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_finder_maps_one_name_only() -> None:
    finder = source_tree.SourceKernelsFinder()
    spec = finder.find_spec("deepinfer.kernels", None)
    assert spec is not None and spec.origin == str(ROOT / "kernels" / "__init__.py")
    assert spec.submodule_search_locations == [str(ROOT / "kernels")]
    for name in ("kernels", "deepinfer", "deepinfer.kernels.dispatch", "deepinfer.model"):
        assert finder.find_spec(name, None) is None


def test_install_is_idempotent() -> None:
    source_tree.install()
    assert sum(isinstance(f, source_tree.SourceKernelsFinder) for f in sys.meta_path) == 1


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["pyproject.toml", "kernels/__init__.py"], True),
        (["pyproject.toml", "kernels/__init__.py", "deepinfer/kernels/__init__.py"], False),
        (["kernels/__init__.py"], False),  # site-packages: another distribution's `kernels`
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
