"""deepinfer subclasses two libraries' private internals, so their versions are pinned exactly in
pyproject.toml: gguf-py's `GGUFReader._get_field_parts` (`deepinfer.model.loading.gguf_loader.Reader`)
and uvicorn's HTTP protocol classes (`deepinfer.api.http.connections`). Moving a pin means reading the
new version's code for those names and updating the pin here and in pyproject.toml together;
these tests fail on any other installed version, and if the names are gone."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import tomllib
from pathlib import Path

import gguf
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PINNED = {"gguf": "0.19.0", "uvicorn": "0.55.0"}
"""The versions whose private code the overrides were written against."""


def _assigns(source: str, attribute: str) -> bool:
    """Whether a class's source sets `self.<attribute>` (annotated or not)."""
    return re.search(rf"self\.{attribute}(: [^=\n]+)? = ", source) is not None


def _dependencies() -> dict[str, Requirement]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {r.name: r for r in map(Requirement, pyproject["project"]["dependencies"])}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_exactly_and_installed(name: str) -> None:
    assert str(_dependencies()[name].specifier) == f"=={PINNED[name]}"
    assert importlib.metadata.version(name) == PINNED[name]


def test_gguf_reader_internals_exist() -> None:
    """What `Reader` overrides and reads of gguf-py's reader."""
    reader = gguf.GGUFReader
    parameters = list(inspect.signature(reader._get_field_parts).parameters)
    assert parameters == ["self", "orig_offs", "raw_type"]
    assert callable(reader._get)
    assert gguf.GGUFValueType.STRING not in reader.gguf_scalar_to_np
    assert gguf.GGUFValueType.UINT32 in reader.gguf_scalar_to_np
    for attribute in ("self.data", "self.byte_order"):
        assert attribute in inspect.getsource(reader), attribute


def test_uvicorn_protocol_internals_exist() -> None:
    """The classes `deepinfer.api.http.connections` subclasses, the methods it overrides and the
    instance attributes it reads, imported from uvicorn itself."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    overridden = {
        h11_impl.H11Protocol: ["connection_made", "connection_lost", "handle_events"],
        httptools_impl.HttpToolsProtocol: [
            "connection_made", "connection_lost", "on_headers_complete", "on_response_complete",
        ],
    }  # fmt: skip
    read = {
        h11_impl.H11Protocol: ["loop", "conn", "transport", "cycle", "client"],
        httptools_impl.HttpToolsProtocol: ["loop", "pipeline", "transport", "cycle", "client"],
    }
    for cls, methods in overridden.items():
        for method in methods:
            assert callable(getattr(cls, method, None)), f"{cls.__name__}.{method}"
        source = inspect.getsource(cls)
        for attribute in read[cls]:
            assert _assigns(source, attribute), f"{cls.__name__}.{attribute}"
    for module in (h11_impl, httptools_impl):
        cycle = inspect.getsource(module.RequestResponseCycle)
        for attribute in ("response_complete", "more_body"):
            assert _assigns(cycle, attribute), f"{module.__name__}: {attribute}"
