"""Imports point down (docs/architecture.md, "Layers"): an AST walk over every module enforces the
layering."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepinfer"
KERNELS = ROOT / "kernels"
"""Installed as `deepinfer.kernels` (pyproject's package-dir), so outside PACKAGE on disk."""

# layer -> deepinfer subpackages it must never import
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"*"},
    "model": {"api", "engine", "scheduler", "cache", "runner", "text", "tiers"},
    "sampling": {"api", "engine", "scheduler", "cache", "runner", "model", "text", "tiers"},
    "cache": {"api", "engine", "runner", "model", "sampling", "text", "scheduler", "tiers"},
    "scheduler": {"api", "engine", "runner", "model", "sampling", "text", "tiers"},
    "runner": {"api", "engine", "scheduler.scheduler", "text", "tiers"},
    "text": {"api", "engine", "scheduler", "cache", "runner", "model", "sampling", "tiers"},
    "tiers": {"api", "engine", "scheduler", "runner", "sampling", "text"},
    "engine": {"api"},
    "kv_transfer": {"api", "engine", "scheduler", "runner", "sampling", "text"},
    "kv_events": {
        "api",
        "engine",
        "scheduler",
        "cache",
        "runner",
        "model",
        "sampling",
        "text",
        "tiers",
    },
}
"""`tiers` (the host and disk KV tiers, their copies and `KVTiers`) sits between `engine` and
`cache` / `model`: only the engine imports it (and the API its leaf of records, `tiers.stats`)."""
NO_TORCH = {"cache", "scheduler", "text", "kv_events"}
NO_ASYNCIO = {"kv_events", "cache", "scheduler", "model", "sampling", "runner", "text", "kernels"}
LEAVES = {
    "config",
    "environment",
    "server_config",
    "errors",
    "request",
    "outputs",
    "message",
    "byte_alphabet",
    "block_ids",
}
KERNELS_MAY_IMPORT = {"environment", "errors", "kernels"}
"""The kernels read their switches (`DEEPINFER_NATIVE*`) through the one environment reader
(`environment.py`, a stdlib-only leaf); their own modules import each other relatively."""


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def _layer(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        return "kernels"
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _package_of(path: Path) -> list[str]:
    """The dotted package a module lives in (kernels/ is `deepinfer.kernels`)."""
    if path.is_relative_to(KERNELS):
        return ["deepinfer", "kernels", *path.relative_to(KERNELS).parent.parts]
    return ["deepinfer", *path.relative_to(PACKAGE).parent.parts]


def _imports(path: Path) -> set[str]:
    """Absolute names of every import, relative ones resolved."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            base = _package_of(path)[: len(_package_of(path)) - node.level + 1]
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


def _violations(path: Path, layer: str | None = None) -> list[str]:
    layer, found = layer or _layer(path), []
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "deepinfer":
            sub = name[len("deepinfer.") :]
            if (
                (layer == "kernels" and sub.split(".")[0] not in KERNELS_MAY_IMPORT)
                or (layer in LEAVES and sub.split(".")[0] not in LEAVES)
                or any(sub == f or sub.startswith(f + ".") for f in FORBIDDEN.get(layer, ()))
            ):
                found.append(name)
        if (
            layer == "kernels"
            and top not in {"torch", "triton", "__future__", "deepinfer"}
            and (top not in sys.stdlib_module_names)
        ):
            found.append(name)
        if layer in NO_TORCH and top in {"torch", "triton", "numpy"}:
            found.append(name)
        if layer in NO_ASYNCIO and top == "asyncio":
            found.append(name)
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path) -> None:
    assert _violations(path) == []


def test_walk_sees_every_layer() -> None:
    layers = {_layer(p) for p in _modules()}
    assert {"kernels", "model", "cache", "tiers", "scheduler", "engine", "text", "config"} <= layers


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    assert _layer(PACKAGE / "scheduler" / "x.py") == "scheduler"
    src = tmp_path / "x.py"
    src.write_text("import torch\nimport asyncio\nfrom deepinfer.engine.core import EngineCore\n")
    assert sorted(_violations(src, "scheduler")) == ["asyncio", "deepinfer.engine.core", "torch"]
    assert _violations(src, "engine") == []


def test_api_names_only_the_tiers_records() -> None:
    """The API imports the tiers' leaf of records (`tiers.stats`), never the tiers themselves."""
    for path in sorted((PACKAGE / "api").rglob("*.py")):
        names = {n for n in _imports(path) if n.split(".")[:2] == ["deepinfer", "tiers"]}
        assert names <= {"deepinfer.tiers.stats"}, path
