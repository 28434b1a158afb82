"""Build and load the native CPU kernels (`cpu/*.c`) with the system C compiler, through ctypes.

`DEEPINFER_NATIVE=0` turns them off (torch paths everywhere), e.g. for A/B measurements.

The library is compiled once per source and flags into a cache directory (`DEEPINFER_NATIVE_DIR`,
else `$XDG_CACHE_HOME/deepinfer/native`, else `~/.cache/deepinfer/native`), atomically: a
temporary file renamed into place, so concurrent processes never load a half-written library.
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

SOURCES = tuple(
    Path(__file__).parent / "cpu" / n
    for n in ("quant_gemm.c", "int8_gemm.c", "paged_attention.c", "elementwise.c", "llama_layers.c")
)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_COMPILE_TIMEOUT_S = 180


class NativeUnavailableError(RuntimeError):
    """The native kernels cannot run here (CPU features, compiler, or build failure)."""


class NativeLibrary:
    """The loaded library's entry points, with their C signatures declared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        v, i = ctypes.c_void_p, ctypes.c_int
        f, long_ = ctypes.c_float, ctypes.c_long
        lib.di_quant_gemm.argtypes = [i, v, v, v, i, i, i, i]
        lib.di_quant_gemm.restype = i
        lib.di_dequantize.argtypes = [i, v, v, i, i, i]
        lib.di_dequantize.restype = i
        lib.di_int8_pack.argtypes = [i, v, v, i, i, i]
        lib.di_int8_pack.restype = i
        lib.di_int8_gemm.argtypes = [i, v, v, v, i, i, i, i]
        lib.di_int8_gemm.restype = i
        lib.di_rms_norm.argtypes = [v, long_, v, long_, v, v, long_, v, long_, i, i, f, i]
        lib.di_rms_norm.restype = i
        lib.di_rotary.argtypes = [v, long_, i, v, long_, i, v, v, long_, i, i, i]
        lib.di_rotary.restype = i
        lib.di_store_kv.argtypes = [v, long_, v, long_, v, v, long_, v, i, i, i]
        lib.di_store_kv.restype = i
        lib.di_silu_mul.argtypes = [v, long_, v, long_, i, i, i]
        lib.di_silu_mul.restype = i
        lib.di_paged_decode_attention.argtypes = [
            v,
            long_,
            long_,
            v,
            v,
            v,
            i,
            v,
            v,
            i,
            i,
            i,
            i,
            i,
            f,
            i,
            i,  # kv_f16
        ]
        lib.di_paged_decode_attention.restype = i
        lib.di_llama_layers.argtypes = [v, i, v, v, v, i]
        lib.di_llama_layers.restype = i
        self._lib = lib

    def gemm(
        self, fmt: int, w: int, x: int, y: int, m: int, n: int, k: int, num_threads: int
    ) -> None:
        """y[m, n] = x[m, k] @ W^T (pointers to contiguous memory)."""
        _check(self._lib.di_quant_gemm(fmt, w, x, y, m, n, k, num_threads))

    def dequantize(self, fmt: int, w: int, out: int, n: int, k: int, num_threads: int) -> None:
        _check(self._lib.di_dequantize(fmt, w, out, n, k, num_threads))

    def int8_pack(self, fmt: int, w: int, out: int, n: int, k: int, num_threads: int) -> None:
        """Repack GGUF blocks for `int8_gemm` (see cpu/int8_gemm.c for the layout)."""
        _check(self._lib.di_int8_pack(fmt, w, out, n, k, num_threads))

    def int8_gemm(
        self, fmt: int, packed: int, x: int, y: int, m: int, n: int, k: int, num_threads: int
    ) -> None:
        """y[m, n] = x[m, k] @ W^T with x quantized to int8 blocks (pointers to contiguous memory)."""
        _check(self._lib.di_int8_gemm(fmt, packed, x, y, m, n, k, num_threads))

    def rms_norm(self, *args: int | float) -> None:
        """See `di_rms_norm` in cpu/elementwise.c (0 for the absent residual's pointers)."""
        _check(self._lib.di_rms_norm(*args))

    def rotary(self, *args: int) -> None:
        """See `di_rotary` in cpu/elementwise.c."""
        _check(self._lib.di_rotary(*args))

    def store_kv(self, *args: int) -> None:
        """See `di_store_kv` in cpu/elementwise.c."""
        _check(self._lib.di_store_kv(*args))

    def silu_mul(self, *args: int) -> None:
        """See `di_silu_mul` in cpu/elementwise.c."""
        _check(self._lib.di_silu_mul(*args))

    def paged_decode_attention(self, *args: int | float) -> None:
        """See `di_paged_decode_attention` in cpu/paged_attention.c for the arguments."""
        _check(self._lib.di_paged_decode_attention(*args))

    def llama_layers(self, *args: object) -> None:
        """See `di_llama_layers` in cpu/llama_layers.c (`llama_layers_cpu` builds the args)."""
        _check(self._lib.di_llama_layers(*args))


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
    override = os.environ.get("DEEPINFER_NATIVE_DIR")
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
    for source in SOURCES:
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
    if os.environ.get("DEEPINFER_NATIVE", "1") == "0":
        return NativeUnavailableError("disabled by DEEPINFER_NATIVE=0")
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
