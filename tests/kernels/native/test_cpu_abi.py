"""The ctypes mirror (`kernels/native/cpu_abi.py`) against the C header it mirrors
(`kernels/cpu/deepinfer_kernels.h`), parsed here, and against the built library: every
prototype bound with its types, every struct's fields in order and its size, every exported
symbol declared, the shared constants equal, and the header part of the build's cache key."""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from deepinfer.kernels.attention.paged_attention_cpu import MAX_GROUP, MAX_HEAD_DIM
from deepinfer.kernels.layers.llama_layers_cpu import Activation
from deepinfer.kernels.linear.quant_matmul import QK, QK_K, QuantFormat
from deepinfer.kernels.native import cpu_abi, cpu_native
from deepinfer.kernels.native.cpu_native import native_available, native_library

needs_native = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")

HEADER = cpu_native.HEADERS[0]
_SCALARS: dict[str, Any] = {
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
}


def _code(text: str) -> str:
    """The header without comments."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def _ctype(decl: str) -> tuple[str, Any]:
    """`const float *x` -> ("x", c_void_p); a struct pointer as POINTER(its mirror)."""
    m = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*(\**)\s*(?:const\s+)?(\w+)\s*", decl)
    assert m is not None, f"the ABI parser cannot read {decl!r}"
    base, stars, name = m.groups()
    struct = cpu_abi.STRUCTS.get(base)
    if stars:
        assert stars == "*", f"{decl!r}: one level of pointer at most"
        return name, ctypes.POINTER(struct) if struct is not None else ctypes.c_void_p
    ctype = struct if struct is not None else _SCALARS.get(base)
    assert ctype is not None, f"{decl!r}: no ctypes type for {base!r}"
    return name, ctype


def parse_structs(code: str) -> dict[str, list[tuple[str, Any]]]:
    """`typedef struct { fields } name;` -> {name: [(field, ctype)]}, in order."""
    out = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", code, flags=re.S):
        out[name] = [_ctype(d) for d in body.split(";") if d.strip()]
    return out


def parse_functions(code: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Prototypes `ret name(params);` -> {name: (restype, argtypes)}."""
    code = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", code, flags=re.S)
    code = re.sub(r"^\s*#[^\n]*", " ", code, flags=re.M)
    out = {}
    for ret, name, params in re.findall(r"(\w+)\s+(\w+)\s*\(([^)]*)\)\s*;", code):
        restype = _SCALARS[ret]
        decls = [] if params.strip() == "void" else params.split(",")
        out[name] = (restype, tuple(_ctype(d)[1] for d in decls))
    return out


def parse_defines(code: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"#define\s+(DI_\w+)\s+(\d+)\b", code)}


@pytest.fixture(scope="module")
def code() -> str:
    return _code(HEADER.read_text())


def test_the_parser_reads_declarations() -> None:
    """The parser on a known snippet, so a parser that reads nothing cannot pass the rest."""
    snippet = _code(
        "typedef struct {\n  const float *x; /* c */ long n;\n  di_matrix m;\n} s_t;\n"
        "int f(const di_llama_step *s, float *y, long n, float e);\nlong g(void);\n"
    )
    assert parse_structs(snippet) == {
        "s_t": [("x", ctypes.c_void_p), ("n", ctypes.c_long), ("m", cpu_abi.Matrix)]
    }
    assert parse_functions(snippet) == {
        "f": (
            ctypes.c_int,
            (ctypes.POINTER(cpu_abi.LlamaStep), ctypes.c_void_p, ctypes.c_long, ctypes.c_float),
        ),
        "g": (ctypes.c_long, ()),
    }


def test_every_prototype_has_a_binding_of_its_types(code: str) -> None:
    header = parse_functions(code)
    assert len(header) >= 10  # the header's prototypes were read
    assert set(header) == set(cpu_abi.FUNCTIONS), "header and bindings name different functions"
    for name, (restype, argtypes) in header.items():
        assert cpu_abi.FUNCTIONS[name] == (restype, argtypes), name


def test_every_struct_is_mirrored_field_by_field(code: str) -> None:
    header = parse_structs(code)
    assert set(header) == set(cpu_abi.STRUCTS)
    for name, fields in header.items():
        assert list(cpu_abi.STRUCTS[name]._fields_) == fields, name


def test_constants_agree_with_the_header(code: str) -> None:
    defines = parse_defines(code)
    assert defines["DI_QK"] == QK
    assert defines["DI_QK_K"] == QK_K
    assert defines["DI_MAX_HEAD_DIM"] == MAX_HEAD_DIM
    assert defines["DI_MAX_GROUP"] == MAX_GROUP
    for fmt in QuantFormat:
        assert defines[f"DI_FMT_{fmt.name}"] == fmt.value, fmt
    assert {k: v for k, v in defines.items() if k.startswith("DI_ACT_")} == {
        f"DI_ACT_{act.name}": act.value for act in Activation
    }


def test_every_source_includes_the_header() -> None:
    names = {h.name for h in cpu_native.HEADERS}
    for source in cpu_native.SOURCES:
        included = set(re.findall(r'#include\s+"([^"]+)"', source.read_text()))
        assert HEADER.name in included, source.name
        assert included <= names, f"{source.name} includes a header the build key misses"
    on_disk = {p.name for p in HEADER.parent.iterdir()}
    assert {p.name for p in HEADER.parent.glob("*.c")} == {s.name for s in cpu_native.SOURCES}
    assert {n for n in on_disk if n.endswith(".h")} == names


@needs_native
def test_struct_sizes_match_the_compiler() -> None:
    lib = native_library()
    for name, struct in cpu_abi.STRUCTS.items():
        assert lib.struct_size(name) == ctypes.sizeof(struct), name


@needs_native
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm here")
def test_every_exported_symbol_is_declared() -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(native_library().path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = {line.split()[2] for line in out.splitlines() if line.split()[1] == "T"}
    assert exported == set(cpu_abi.FUNCTIONS)


@needs_native
def test_packed_size_comes_from_the_library() -> None:
    lib = native_library()
    # 9 rows: 2 groups of 8 (the last padded) x 2 blocks x (256 bytes + 8 float16 scales)
    assert lib.int8_packed_bytes(int(QuantFormat.Q8_0), 9, 64) == 2 * 2 * 272
    # K-quants: 2 groups x 2 superblocks x (8 sub-blocks' quants + the scales' lanes)
    assert lib.int8_packed_bytes(int(QuantFormat.Q4_K), 9, 512) == 2 * 2 * (8 * 128 + 160)
    assert lib.int8_packed_bytes(int(QuantFormat.Q5_K), 9, 512) == 2 * 2 * (8 * 160 + 160)
    assert lib.int8_packed_bytes(int(QuantFormat.Q6_K), 9, 512) == 2 * 2 * (8 * 192 + 144)
    with pytest.raises(ValueError, match="no int8 packing"):
        lib.int8_packed_bytes(int(QuantFormat.Q4_1), 8, 48)
    with pytest.raises(ValueError, match="no int8 packing"):
        lib.int8_packed_bytes(int(QuantFormat.Q6_K), 8, 288)  # not whole superblocks
    with pytest.raises(ValueError, match="no int8 packing"):
        lib.int8_packed_bytes(len(QuantFormat), 8, 256)  # no such format


def _fake_compiler(path: Path) -> Path:
    """A `cc` that writes an empty output: build() runs without compiling anything."""
    path.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or not cpu_native.cpu_flags() >= cpu_native.REQUIRED_CPU_FLAGS,
    reason="build() refuses this CPU before it compiles",
)
def test_a_header_change_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path / "cc")))
    headers = []
    for h in cpu_native.HEADERS:
        headers.append(tmp_path / h.name)
        shutil.copy(h, headers[-1])
    monkeypatch.setattr(cpu_native, "HEADERS", tuple(headers))
    first = cpu_native.build(tmp_path / "lib")
    assert cpu_native.build(tmp_path / "lib") == first
    headers[0].write_text(headers[0].read_text() + "\n")
    second = cpu_native.build(tmp_path / "lib")
    assert second != first and second.exists()
