"""A Mixture-of-Experts layer's quantized experts in one native call (`cpu/moe_experts.c`), for
the `cpu` backend: the rows of a step's runs (each run all one expert's, sorted as
`moe_torch.combine_pairs` sorts them) through gate_up, silu * up and down, bit-identical to
three Python calls a run (`block_linear`, `silu_mul`, `block_linear`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ..layers.llama_layers_cpu import matrix
from ..linear.int8_matmul import BlockWeight
from ..native.cpu_abi import Matrix
from ..native.cpu_native import native_library

Run = tuple[int, int]
"""(expert, rows): a run of rows all routed to one expert."""


class NativeExperts:
    """Every expert of one layer as the native call reads them (built once; raises ValueError
    where a weight is not in a native format)."""

    def __init__(self, gate_up: Sequence[BlockWeight], down: Sequence[BlockWeight]) -> None:
        self.hidden = gate_up[0].in_features
        self.intermediate = down[0].in_features
        i, d = self.intermediate, self.hidden
        self._gate_up = (Matrix * len(gate_up))(*(matrix(w, 2 * i, d) for w in gate_up))
        self._down = (Matrix * len(down))(*(matrix(w, d, i) for w in down))
        self._weights = (list(gate_up), list(down))  # keeps the blocks the structs point to
        self._lib = native_library()

    def run(self, x: torch.Tensor, runs: Sequence[Run]) -> torch.Tensor:  # [n, D] -> [n, D]
        """Each run's rows of `x` (consecutive, in run order) through its expert's FFN."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != self.hidden:
            raise ValueError(f"native experts take float32 CPU [n, {self.hidden}] rows")
        if (total := sum(n for _, n in runs)) != x.shape[0]:
            raise ValueError(f"runs of {total} rows for {x.shape[0]}")
        x = x.contiguous()
        y = torch.empty_like(x)
        experts = (ctypes.c_int * len(runs))(*(e for e, _ in runs))
        rows = (ctypes.c_int * len(runs))(*(n for _, n in runs))
        self._lib.moe_experts(
            self._gate_up, self._down,
            (len(runs), ctypes.addressof(experts), ctypes.addressof(rows)),
            x.data_ptr(), y.data_ptr(), self.hidden, self.intermediate, torch.get_num_threads(),
        )  # fmt: skip
        return y
