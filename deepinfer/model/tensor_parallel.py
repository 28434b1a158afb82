"""What a tensor-parallel model needs of its ranks (`runner/tensor_ranks.py` provides it)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from deepinfer.model.forward_batch import ForwardBatch

ShardProduct = Callable[[torch.Tensor | None], torch.Tensor]
"""A row-cut projection's product over this rank's slice of its input features: from zero
(None), or going on from the sums of the ranks before (their output)."""


class RowCutSum(Protocol):
    def __call__(
        self, product: ShardProduct, shape: tuple[int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        """The projection's [rows, out] output of `dtype`, summed over every rank's slice,
        given this rank's `product`."""
        ...


class StepLeader(Protocol):
    def step(self, batch: ForwardBatch, num_layers: int | None) -> AbstractContextManager[None]:
        """Send the forward of `batch` to the other ranks and hold the group for it: the
        forward runs inside, its all-reduces matched by theirs, one forward at a time."""
        ...
