"""Build and load the native CPU kernels (`cpu/*.c`) with the system C compiler, through ctypes.

`DEEPINFER_NATIVE=0` turns them off (torch paths everywhere), e.g. for A/B measurements.

The library is compiled once per source, header and flags into a cache directory
(`DEEPINFER_NATIVE_DIR`, else `$XDG_CACHE_HOME/deepinfer/native`, else
`~/.cache/deepinfer/native`), atomically: a temporary file renamed into place, so concurrent
processes never load a half-written library.
It needs x86-64 with AVX2, FMA and F16C, and a C compiler with OpenMP (`$CC`, else `cc`);
anything missing raises `NativeUnavailableError` with the reason, and callers fall back to
torch. ctypes releases the GIL for the call, so two worker threads can run kernels at once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...environment import env_name, env_value
from .cpu_abi import AttentionArgs, LlamaLayer, LlamaStep, Matrix, RmsNormArgs, declare

SOURCES = tuple(
    Path(__file__).parents[1] / "cpu" / n
    for n in (
        "dequant.c", "quant_gemm.c", "int8_gemm.c", "int8_kquants.c", "int8_unpack.c",
        "paged_attention.c", "elementwise.c", "llama_layers.c", "moe_experts.c", "sampling.c",
        "abi.c",
    )
)  # fmt: skip
HEADERS = tuple(
    Path(__file__).parents[1] / "cpu" / n
    for n in ("deepinfer_kernels.h", "simd.h", "team.h", "parts.h", "blocks.h", "int8.h")
)
"""Included by the sources: part of the build's cache key."""
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
    "-Werror=missing-prototypes",
)  # fmt: skip
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_COMPILE_TIMEOUT_S = 180


class NativeUnavailableError(RuntimeError):
    """The native kernels cannot run here (CPU features, compiler, or build failure)."""


class NativeLibrary:
    """The loaded library's entry points, with their C signatures declared (`cpu_abi`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        declare(lib)
        self._lib = lib

    def gemm(
        self, fmt: int, w: int, x: int, y: int, m: int, n: int, k: int, num_threads: int
    ) -> None:
        """y[m, n] = x[m, k] @ W^T (pointers to contiguous memory)."""
        _check(self._lib.di_quant_gemm(fmt, w, x, y, m, n, k, num_threads))

    def dequantize(self, fmt: int, w: int, out: int, n: int, k: int, num_threads: int) -> None:
        _check(self._lib.di_dequantize(fmt, w, out, n, k, num_threads))

    def q5_0_to_q8_0(self, src: int, dst: int, nblocks: int, num_threads: int) -> None:
        """Q5_0 blocks as the Q8_0 blocks of the same values (see cpu/dequant.c)."""
        _check(self._lib.di_q5_0_to_q8_0(src, dst, nblocks, num_threads))

    def int8_packed_bytes(self, fmt: int, n: int, k: int) -> int:
        """Bytes of an [n, k] weight repacked by `int8_pack`; ValueError for shapes it refuses."""
        size = int(self._lib.di_int8_packed_bytes(fmt, n, k))
        if size <= 0:
            raise ValueError(f"no int8 packing of a {n}x{k} weight in format {fmt}")
        return size

    def int8_pack(self, fmt: int, w: int, out: int, n: int, k: int, num_threads: int) -> None:
        """Repack GGUF blocks for `int8_gemm` (see cpu/int8_gemm.c for the layout)."""
        _check(self._lib.di_int8_pack(fmt, w, out, n, k, num_threads))

    def int8_gemm(
        self, fmt: int, packed: int, x: int, y: int, m: int, n: int, k: int, num_threads: int
    ) -> None:
        """y[m, n] = x[m, k] @ W^T with x quantized to int8 blocks (pointers to contiguous memory)."""
        _check(self._lib.di_int8_gemm(fmt, packed, x, y, m, n, k, num_threads))

    def int8_gemm_split(
        self,
        fmt: int,
        fmt2: int,
        n2: int,
        packed: int,
        x: int,
        y: int,
        m: int,
        n: int,
        k: int,
        num_threads: int,
        going_on: bool = False,
    ) -> None:
        """`int8_gemm` of a weight whose last n2 rows are in fmt2 (see di_int8_gemm_split);
        `going_on`: every output's sum continues from y's value (di_int8_gemm_acc), so chained
        slices of K give one product's bits."""
        gemm = self._lib.di_int8_gemm_acc if going_on else self._lib.di_int8_gemm_split
        _check(gemm(fmt, fmt2, n2, packed, x, y, m, n, k, num_threads))

    def int8_unpack_bf16(
        self, fmt: int, packed: int, n: int, k: int, row0: int, rows: int, out: int, threads: int
    ) -> None:
        """Rows [row0, row0 + rows) of an `int8_pack`ed weight as bfloat16 into out[rows, k]
        (row0 a multiple of 8): the weights `dequantize_reference` gives, rounded to nearest."""
        _check(self._lib.di_int8_unpack_bf16(fmt, packed, n, k, row0, rows, out, threads))

    def int8_isa(self, want: int = -1) -> int:
        """The int8 matmuls' instructions: 1 AVX-512 VNNI, 0 AVX2. `want` 1 picks VNNI where the
        CPU has it (what the library loads with), 0 AVX2, -1 keeps the choice. Same bits."""
        return int(self._lib.di_int8_isa(want))

    def int8_pairs(self, want: int = -1) -> int:
        """Whether K-quant VNNI passes take two groups at once in 512-bit vectors (1) or not
        (0); `want` sets it, -1 keeps it. Same bits."""
        return int(self._lib.di_int8_pairs(want))

    def rms_norm(self, args: RmsNormArgs) -> None:
        """See `di_rms_norm_args` in cpu/deepinfer_kernels.h."""
        _check(self._lib.di_rms_norm(ctypes.byref(args)))

    def rotary(self, *args: int) -> None:
        """See `di_rotary` in cpu/elementwise.c."""
        _check(self._lib.di_rotary(*args))

    def store_kv(self, *args: int) -> None:
        """See `di_store_kv` in cpu/elementwise.c."""
        _check(self._lib.di_store_kv(*args))

    def silu_mul(self, *args: int) -> None:
        """See `di_silu_mul` in cpu/elementwise.c."""
        _check(self._lib.di_silu_mul(*args))

    def gelu_tanh_mul(self, *args: int) -> None:
        """See `di_gelu_tanh_mul` in cpu/elementwise.c."""
        _check(self._lib.di_gelu_tanh_mul(*args))

    def argmax_rows(self, x: int, stride: int, rows: int, v: int, out: int, threads: int) -> None:
        """See `di_argmax_rows` in cpu/sampling.c."""
        _check(self._lib.di_argmax_rows(x, stride, rows, v, out, threads))

    def paged_decode_attention(self, args: AttentionArgs) -> None:
        """See `di_attention_args` in cpu/deepinfer_kernels.h."""
        _check(self._lib.di_paged_decode_attention(ctypes.byref(args)))

    def llama_layers(
        self, layers: ctypes.Array[LlamaLayer], step: LlamaStep, h: int, residual: int
    ) -> None:
        """See `di_llama_layers` in cpu/llama_layers.c (`llama_layers_cpu` builds the args)."""
        _check(self._lib.di_llama_layers(layers, len(layers), ctypes.byref(step), h, residual, 0))

    def moe_experts(
        self,
        gate_up: ctypes.Array[Matrix],
        down: ctypes.Array[Matrix],
        runs: tuple[int, int, int],
        x: int,
        y: int,
        hidden: int,
        intermediate: int,
        num_threads: int,
    ) -> None:
        """See `di_moe_experts` in cpu/moe_experts.c; `runs`: (how many, experts, rows)."""
        shape = (hidden, intermediate, num_threads)
        _check(self._lib.di_moe_experts(gate_up, down, len(gate_up), *runs, x, y, *shape))

    def struct_size(self, name: str) -> int:
        """sizeof the header's struct `name` (e.g. "di_llama_step"), as the library has it."""
        return int(getattr(self._lib, f"di_sizeof_{name.removeprefix('di_')}")())


def _check(status: int) -> None:
    if status == -2:
        raise MemoryError("native CPU kernel: out of memory for its buffers")
    if status != 0:
        raise ValueError(f"native CPU kernel rejected its arguments (status {status})")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_dir() -> Path:
    override = env_value("native_dir")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer" / "native"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise NativeUnavailableError(f"no C compiler ({cc!r} not found on PATH)")
    return path


def build(directory: Path) -> Path:
    """Compile the library into `directory` unless an identical build is there; its path."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailableError(f"native kernels need x86-64, not {platform.machine()}")
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        raise NativeUnavailableError(f"the CPU lacks {', '.join(sorted(missing))}")
    cc = _compiler()
    digest = hashlib.sha256(" ".join((cc, *FLAGS)).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    target = directory / f"deepinfer_cpu-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailableError(f"cannot write to {directory}: {exc}") from exc
    try:
        proc = subprocess.run(
            [cc, *FLAGS, "-o", tmp, *map(str, SOURCES)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise NativeUnavailableError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeUnavailableError(f"building the native kernels failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> NativeLibrary | NativeUnavailableError:
    if env_value("native") == "0":
        return NativeUnavailableError(f"disabled by {env_name('native')}=0")
    try:
        path = build(native_dir())
        return NativeLibrary(path)
    except NativeUnavailableError as exc:
        return exc
    except OSError as exc:
        return NativeUnavailableError(f"cannot load the native kernels: {exc}")


def native_library() -> NativeLibrary:
    """The library, built on first use (seconds) and loaded once per process; raises
    `NativeUnavailableError` (the same answer every time) when it cannot run here."""
    lib = _load()
    if isinstance(lib, NativeUnavailableError):
        raise lib
    return lib


def native_available() -> bool:
    return not isinstance(_load(), NativeUnavailableError)
