"""Imports point down (docs/architecture.md, "Layers"): an AST walk over every module enforces the
layering."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepinfer"

# layer -> deepinfer subpackages it must never import
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"*"},
    "model": {"api", "engine", "scheduler", "cache", "runner", "text"},
    "sampling": {"api", "engine", "scheduler", "cache", "runner", "model", "text"},
    "cache": {"api", "engine", "runner", "model", "sampling", "text", "scheduler"},
    "scheduler": {"api", "engine", "runner", "model", "sampling", "text"},
    "runner": {"api", "engine", "scheduler.scheduler", "text"},
    "text": {"api", "engine", "scheduler", "cache", "runner", "model", "sampling"},
    "engine": {"api"},
}
NO_TORCH = {"cache", "scheduler", "text"}
NO_ASYNCIO = {"cache", "scheduler", "model", "sampling", "runner", "text", "kernels"}
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
    files = [p for p in PACKAGE.rglob("*.py") if "kernels" not in p.relative_to(PACKAGE).parts]
    return files + sorted((ROOT / "kernels").glob("*.py"))


def _layer(path: Path) -> str:
    if path.is_relative_to(ROOT / "kernels"):
        return "kernels"
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _package_of(path: Path) -> list[str]:
    """The dotted package a module lives in (kernels/ is `deepinfer.kernels`)."""
    if path.is_relative_to(ROOT / "kernels"):
        return ["deepinfer", "kernels"]
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
    assert {"kernels", "model", "cache", "scheduler", "engine", "text", "config"} <= layers


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    assert _layer(PACKAGE / "scheduler" / "x.py") == "scheduler"
    src = tmp_path / "x.py"
    src.write_text("import torch\nimport asyncio\nfrom deepinfer.engine.core import EngineCore\n")
    assert sorted(_violations(src, "scheduler")) == ["asyncio", "deepinfer.engine.core", "torch"]
    assert _violations(src, "engine") == []


def _module_name(path: Path) -> str:
    parts = [*_package_of(path), path.stem]
    return ".".join(parts[:-1] if path.stem == "__init__" else parts)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (module -> the modules it imports) as a path, or []."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return []
        for dep in sorted(graph[name]):
            found = visit(dep, [*path, name])
            if found:
                return found
        done.add(name)
        return []

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return []


def test_api_has_no_import_cycles() -> None:
    """No cycle among the api's modules, not even through imports made for type checking only
    (the AST walk sees every import, wherever it stands)."""
    names = {_module_name(p): p for p in _modules() if _layer(p) == "api"}
    graph = {name: {i for i in _imports(p) if i in names} for name, p in names.items()}
    assert len(names) > 40
    assert _cycle(graph) == []


def test_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
