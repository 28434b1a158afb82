"""`deepinfer.kernels` is the repo's kernels/ folder, and no top-level `kernels` name is shipped
or imported (an unrelated PyPI package owns it)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepinfer.kernels

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_TOP_LEVEL = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)
TRITON_MODULES = {
    "triton_common", "attention.kv_store", "attention.paged_attention",
    "attention.paged_attention_kernels", "elementwise.norm", "elementwise.rotary",
    "linear.matmul", "moe.moe_grouped",
}  # fmt: skip
"""The Triton launchers and kernels: the only modules that load Triton (the `triton` backend's)."""


def _kernel_modules() -> list[str]:
    """The package and every module under kernels/, by its installed name."""
    names = ["deepinfer.kernels"]
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = path.relative_to(ROOT / "kernels").with_suffix("").parts
        names.append(
            ".".join(["deepinfer", "kernels", *parts[: -1 if parts[-1] == "__init__" else None]])
        )
    return names


def test_deepinfer_kernels_is_the_repo_folder() -> None:
    assert deepinfer.kernels.__name__ == "deepinfer.kernels"
    assert [Path(p).resolve() for p in deepinfer.kernels.__path__] == [ROOT / "kernels"]
    for name in _kernel_modules()[1:]:
        module = importlib.import_module(name)
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().is_relative_to(ROOT / "kernels"), name


@pytest.mark.slow
def test_no_top_level_kernels_module_of_ours_is_importable(tmp_path: Path) -> None:
    """deepinfer never imports its kernels as a top-level `kernels` (an unrelated PyPI package owns
    that name), and with the repository root off sys.path no `kernels` of ours can be imported.
    The child process sees this checkout's deepinfer/ through a link in a folder of its own (as
    an editable install maps it), not through the root, where kernels/ would be found by name."""
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "deepinfer").symlink_to(ROOT / "deepinfer")
    code = (
        "import importlib, importlib.util, pathlib, sys\n"
        f"root = pathlib.Path({str(ROOT)!r})\n"
        f"for name in {_kernel_modules()[1:]!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    assert pathlib.Path(module.__file__).resolve().is_relative_to(root / 'kernels')\n"
        "import deepinfer.engine.core, deepinfer.api.app\n"
        "assert 'kernels' not in sys.modules, sys.modules['kernels']\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is None or not pathlib.Path(spec.origin).resolve().is_relative_to(root), spec\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "path")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not hasattr(importlib.import_module("deepinfer.kernels"), "__version__")


def test_an_installed_kernels_distribution_wins_over_the_folder() -> None:
    """With the repository root first on sys.path (`python -m pytest`, `python -c` run there),
    `import kernels` never finds the folder as a regular package: it is a namespace package, so
    a `kernels` distribution anywhere on the path (transformers imports the Hub's) comes first."""
    code = (
        "import importlib.util, pathlib\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec is not None and spec.origin is not None else '')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    origin = proc.stdout.strip()
    assert not origin or not Path(origin).resolve().is_relative_to(ROOT), origin
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_kernel_modules_import_only_torch_triton_and_stdlib() -> None:
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED_TOP_LEVEL, f"{path.name} imports {name}"


@pytest.mark.slow
def test_only_the_triton_modules_load_triton() -> None:
    """The package and every other kernel module (dispatch, the torch references, the native CPU
    kernels: what the CPU path imports) import without loading Triton."""
    relative = [n.removeprefix("deepinfer.kernels.") for n in _kernel_modules()[1:]]
    assert set(relative) >= TRITON_MODULES
    code = (
        "import importlib, sys\n"
        f"for name in {[n for n in relative if n not in TRITON_MODULES]!r}:\n"
        "    importlib.import_module('deepinfer.kernels.' + name)\n"
        "import deepinfer.model.llama, deepinfer.model.attention\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
