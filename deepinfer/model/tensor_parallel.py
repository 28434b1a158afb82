"""What a tensor-parallel model needs of its ranks (`runner/tensor_ranks.py` provides it)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from deepinfer.model.forward_batch import ForwardBatch


class StepLeader(Protocol):
    def step(self, batch: ForwardBatch, num_layers: int | None) -> AbstractContextManager[None]:
        """Send the forward of `batch` to the other ranks and hold the group for it: the
        forward runs inside, its all-reduces matched by theirs, one forward at a time."""
        ...
