"""Which request fields the API's code reads, found by an AST walk over `deepinfer/api`.

A value is known to have a request type T when it is a parameter annotated with T (alone, in a
union or a container), a body decoded as T (`x = await ctx.read_json(request, T)`), or a field
of a class annotated with T (`self.req`, and a name assigned from one). Reading `x.f` (or
`getattr(x, "f", ...)`) counts as reading field `f` of T, and of every request type built on T.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

_WORD = re.compile(r"\w+")

Types = dict[str, set[str]]
"""A name (a variable or an attribute) -> the request type names it may hold."""


def field_reads(root: Path, type_names: Iterable[str]) -> dict[str, set[str]]:
    """Type name -> the attributes read from values of that type, under `root`."""
    names = set(type_names)
    trees = [ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))]
    typed_attrs: Types = defaultdict(set)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        typed_attrs[stmt.target.id] |= _types(stmt.annotation, names)
    found: dict[str, set[str]] = defaultdict(set)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                _scan(node, names, typed_attrs, found)
    return found


def _types(annotation: ast.expr | None, names: set[str]) -> set[str]:
    if annotation is None:
        return set()
    return set(_WORD.findall(ast.unparse(annotation))) & names


def _scan(
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    names: set[str],
    typed_attrs: Types,
    found: dict[str, set[str]],
) -> None:
    local: Types = defaultdict(set)
    args = fn.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        local[arg.arg] |= _types(arg.annotation, names)
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                local[target.id] |= _assigned(node.value, names, typed_attrs)
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute):
            for t in _held(node.value, local, typed_attrs):
                found[t].add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            for t in _held(node.args[0], local, typed_attrs):
                found[t].add(str(node.args[1].value))


def _assigned(value: ast.expr, names: set[str], typed_attrs: Types) -> set[str]:
    if isinstance(value, ast.Await):
        value = value.value
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "read_json"
        and len(value.args) == 2
        and isinstance(value.args[1], ast.Name)
        and value.args[1].id in names
    ):
        return {value.args[1].id}
    if isinstance(value, ast.Attribute):
        return set(typed_attrs.get(value.attr, ()))
    return set()


def _held(value: ast.expr, local: Types, typed_attrs: Types) -> set[str]:
    if isinstance(value, ast.Name):
        return local.get(value.id, set())
    if isinstance(value, ast.Attribute):
        return set(typed_attrs.get(value.attr, ()))
    return set()
