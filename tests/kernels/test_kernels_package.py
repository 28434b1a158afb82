"""`deepinfer.kernels` is the repo's kernels/ folder, and no top-level `kernels` name is shipped
or imported (an unrelated PyPI package owns it)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

from setuptools import find_packages

import deepinfer.kernels

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_TOP_LEVEL = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)


def test_deepinfer_kernels_is_the_repo_folder() -> None:
    assert deepinfer.kernels.__name__ == "deepinfer.kernels"
    assert deepinfer.kernels.__file__ is not None
    assert Path(deepinfer.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    module = importlib.import_module("deepinfer.kernels.paged_attention")
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().parent == ROOT / "kernels"


def test_no_top_level_kernels_module_is_loaded_or_packaged() -> None:
    for path in sorted((ROOT / "kernels").glob("*.py")):
        importlib.import_module(f"deepinfer.kernels.{path.stem}")
    loaded = sys.modules.get("kernels")
    assert loaded is None or not str(getattr(loaded, "__file__", "")).startswith(str(ROOT))
    packages = find_packages(where=str(ROOT), include=["deepinfer*"])
    assert "deepinfer.kernels" in packages
    assert "kernels" not in packages


def test_kernel_modules_import_only_torch_triton_and_stdlib() -> None:
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED_TOP_LEVEL, f"{path.name} imports {name}"
