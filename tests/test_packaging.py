"""The distribution holds every package and the native sources: kernels/ installs as
`deepinfer.kernels` through pyproject's package-dir mapping, which needs the packages listed by
name; this keeps that list equal to the folders on disk."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_kernels_folder_maps_to_deepinfer_kernels() -> None:
    assert SETUPTOOLS["package-dir"] == {"deepinfer.kernels": "kernels"}
    assert not (ROOT / "deepinfer" / "kernels").exists()


def test_packages_listed_are_the_folders_on_disk() -> None:
    on_disk = find_packages(where=str(ROOT), include=["deepinfer", "deepinfer.*"])
    on_disk += ["deepinfer.kernels"]
    on_disk += ["deepinfer.kernels." + p for p in find_packages(where=str(ROOT / "kernels"))]
    assert sorted(SETUPTOOLS["packages"]) == sorted(on_disk)
    assert not any(p == "kernels" or p.startswith("kernels.") for p in SETUPTOOLS["packages"])


def _package_of(path: Path) -> tuple[str, Path]:
    """The installed package a data file belongs to, and its path relative to that package."""
    folder = path.parent
    while not (folder / "__init__.py").is_file() and folder != ROOT / "kernels":
        folder = folder.parent  # kernels/ itself is a namespace package (no __init__.py)
    parts = folder.relative_to(ROOT / "kernels").parts
    return ".".join(["deepinfer", "kernels", *parts]), path.relative_to(folder)


def test_native_sources_are_package_data() -> None:
    """Every C source and header under kernels/ (compiled at run time) matches a data pattern."""
    data = SETUPTOOLS["package-data"]
    native = [p for p in (ROOT / "kernels").rglob("*") if p.suffix in {".c", ".h"}]
    assert native
    for path in native:
        package, relative = _package_of(path)
        assert any(fnmatch(str(relative), pattern) for pattern in data.get(package, [])), path
