"""Long prefill chunks' matmuls as bfloat16 tiles: the int8-packed weight unpacked a tile of rows
at a time (`cpu/int8_unpack.c`, into a buffer that stays in cache) and multiplied by torch's
bf16 matmul, which runs on AMX tiles (or AVX-512 BF16) where the CPU has them.

Where the CPU has AMX, such a matmul multiplies some 3x more per second than the int8 kernel's
VNNI passes, and at a few hundred rows the unpacking (each weight once a call) costs little
beside it. Few rows do not amortize it: decode steps keep the int8 kernel. The numerics
differ from the int8 kernel's: the weights are the exact dequantized values rounded to bfloat16
(relative error 2^-9), x is rounded to bfloat16 (instead of int8 blocks of 32), the sums are
float32 and each output is rounded to bfloat16 before it is widened back. Which rows a
product takes depends on the chunk, so batch-invariant mode never uses it.

Whether the machine multiplies bf16 fast is measured, not read from cpuinfo flags (a VM may
list AMX and fault on its tiles): `probe.py` runs the same matmul in a child process first.
"""

from __future__ import annotations

import torch

from ..native.cpu_native import native_library
from .int8_packed import GROUP_ROWS, Int8PackedWeight, packed_bytes
from .quant_matmul import linear_operands

MIN_ROWS = 256
"""Rows from which the tiles beat the int8 kernel (at 128 rows they run at half its rate, at
512 1.6-2.2x it, on the 1.5B model's projections where AMX runs)."""
TILE_BYTES = 4 << 20
"""Bytes of bf16 weights unpacked per matmul call (measured on the 1.5B's 17920x1536 Q4_K
projection at 256-512 rows: 0.5 MiB tiles 370-530 GOP/s, 1 MiB 550-590, 4 MiB 800-830, 8 MiB
820-910; the int8 kernel 490)."""


def _parts(w: Int8PackedWeight) -> list[tuple[int, int, int, int]]:
    """(format, byte offset, rows, first output row) of each run of one format."""
    fmt2, rows2 = w.second
    first = w.out_features - rows2
    parts = [(int(w.fmt), 0, first, 0)] if first else []
    if rows2:
        offset = packed_bytes(w.fmt, first, w.in_features) if first else 0
        parts.append((int(fmt2), offset, rows2, first))
    return parts


def unpack_bf16(w: Int8PackedWeight) -> torch.Tensor:  # [N, K] bfloat16
    """The whole weight as bfloat16 rows (the tests' view of what the tiles hold)."""
    out = torch.empty((w.out_features, w.in_features), dtype=torch.bfloat16)
    lib, base, k = native_library(), w.packed.data_ptr(), w.in_features
    for fmt, offset, rows, row in _parts(w):
        lib.int8_unpack_bf16(
            fmt, base + offset, rows, k, 0, rows, out[row].data_ptr(), torch.get_num_threads()
        )
    return out


def bf16_tiled_linear(x: torch.Tensor, w: Int8PackedWeight) -> torch.Tensor:  # [M, N] fp32
    """x @ W^T through bf16 tiles of W's rows (see the module docstring)."""
    x, y = linear_operands("bf16_tiled_linear", x, w.out_features, w.in_features)
    if not y.shape[0]:
        return y
    k = w.in_features
    tile = max(GROUP_ROWS, TILE_BYTES // (2 * k) // GROUP_ROWS * GROUP_ROWS)
    buf = torch.empty((tile, k), dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    lib, base, threads = native_library(), w.packed.data_ptr(), torch.get_num_threads()
    for fmt, offset, rows, row in _parts(w):
        for r0 in range(0, rows, tile):
            n = min(tile, rows - r0)
            lib.int8_unpack_bf16(fmt, base + offset, rows, k, r0, n, buf.data_ptr(), threads)
            y[:, row + r0 : row + r0 + n] = torch.mm(xb, buf[:n].t())
    return y
