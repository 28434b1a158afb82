"""The int8 kernel's packed weight: GGUF blocks repacked once into groups of 8 rows (the layout
of `cpu/int8_gemm.c` and `cpu/int8_kquants.c`), which the int8 matmul and the bf16 tiles read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..native.cpu_native import native_library
from .quant_matmul import QuantFormat

GROUP_ROWS = 8
"""Rows the kernel packs together (`GROUP` in cpu/int8_gemm.c)."""


@dataclass(frozen=True)
class Int8PackedWeight:
    """A [out_features, in_features] weight repacked for the int8 kernel (see int8_gemm.c)."""

    fmt: QuantFormat
    packed: torch.Tensor  # uint8 [di_int8_packed_bytes], contiguous CPU
    out_features: int
    in_features: int
    fmt2: QuantFormat | None = None
    """The format of the last `rows2` rows, packed after the others (a fused projection whose
    parts are stored in two formats); None: every row is in `fmt`."""
    rows2: int = 0
    bf16_rows: int = 0
    """Products of at least this many rows run as bf16 tiles (`bf16_tiles.py`); 0: never."""

    @property
    def second(self) -> tuple[QuantFormat, int]:
        """(the format of the last rows, how many): (`fmt`, 0) for a weight in one format."""
        return (self.fmt if self.fmt2 is None else self.fmt2), self.rows2

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def packed_bytes(fmt: QuantFormat, out_features: int, in_features: int) -> int:
    """Bytes of the repacked weight, as the kernel computes them (`di_int8_packed_bytes`)."""
    return native_library().int8_packed_bytes(int(fmt), out_features, in_features)
