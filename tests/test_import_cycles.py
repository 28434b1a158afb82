"""No import cycles among deepinfer's modules, not even through imports made only for type
checking: an AST walk over every module (kernels/ as `deepinfer.kernels`) builds the import
graph, and its strongly connected components must all be single modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepinfer"


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package and of kernels/."""
    found: dict[str, Path] = {}
    roots = [(PACKAGE, ["deepinfer"]), (ROOT / "kernels", ["deepinfer", "kernels"])]
    for base, prefix in roots:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if base == PACKAGE and rel.parts[0] == "kernels":
                continue  # kernels/ is walked from the top level
            parts = [*prefix, *rel.parent.parts]
            if path.stem != "__init__":
                parts.append(path.stem)
            found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules one import statement names (`from a import b`: `a.b` when it is a
    module, else `a`)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    targets = {f"{source}.{a.name}" for a in node.names} & modules.keys()
    return targets or ({source} & modules.keys())


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            edges |= _imported(name, path, node, modules)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _module_files()
    assert {
        "deepinfer.engine.core",
        "deepinfer.api.app",
        "deepinfer.api.openai.routes",
    } <= modules.keys()
    assert any(name.startswith("deepinfer.kernels.") for name in modules)
    assert cycles(import_graph(modules)) == []


def test_the_walk_finds_a_cycle_through_type_checking(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    (tmp_path / "c.py").write_text("from . import a\n")
    modules = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abc"}
    graph = import_graph(modules)
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
