"""A float matmul whose every output is one sum in one order, whatever the number of rows and
threads: the batch-invariant mode's small float matrices on CPU (a Mixture of Experts' routers,
which GGUF files keep in float32), where BLAS picks its blocking by the shape.

Each output x[t] . w[e] is summed in runs of `RUN` products (ATen reduces a contiguous run of one
output alone, with a pattern fixed by the run's length; threads split outputs, never a run),
then the runs' sums are added one after another. Rows go through in slices of bounded memory;
a row's arithmetic is the same in any slice. Slow for large matrices (no BLAS): only for the
few small ones the quantized kernel does not serve."""

from __future__ import annotations

from dataclasses import dataclass

import torch

RUN = 64
SLICE_ELEMENTS = 1 << 21
"""Products held at once (8 MiB of float32)."""


@dataclass(frozen=True)
class FloatMatrix:
    """A float [out_features, in_features] weight that a kernel of its own multiplies."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


@dataclass(frozen=True)
class FixedSumWeight(FloatMatrix):
    """A float weight multiplied by `fixed_sum_linear`."""


def fixed_sum_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [T, D] x [E, D]
    """x @ w.T in float32, each output summed in one fixed order (see the module)."""
    t, d = x.shape
    e = w.shape[0]
    pad = -d % RUN
    w32 = torch.nn.functional.pad(w.float(), (0, pad)).view(e, -1, RUN)  # [E, R, RUN]
    x32 = torch.nn.functional.pad(x.float(), (0, pad)).view(t, 1, -1, RUN)
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    rows = max(1, SLICE_ELEMENTS // max(e * (d + pad), 1))
    for start in range(0, t, rows):
        runs = (x32[start : start + rows] * w32).sum(dim=-1)  # [t, E, R]
        acc = runs[..., 0].clone()
        for r in range(1, runs.shape[-1]):
            acc += runs[..., r]
        out[start : start + rows] = acc
    return out.to(x.dtype)
