"""`StepGraphs`: the CUDA graphs a runner replays its steps from (the one seam the runner sees)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.runner.cuda_graphs import DecodeGraphs
from deepinfer.runner.prefill_graphs import PrefillGraphs


@dataclass(frozen=True)
class StepGraphs:
    """Decode-only steps from the decode graphs (whole forwards by batch size); any other step,
    or a decode step those do not take, from the prefill pieces (by token count)."""

    decode: DecodeGraphs | None = None
    prefill: PrefillGraphs | None = None

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The step's logits from a graph, or None: run it eagerly."""
        if self.decode is not None and (logits := self.decode.run(batch)) is not None:
            return logits
        return self.prefill.run(batch) if self.prefill is not None else None

    @property
    def num_replays(self) -> int:
        return sum(g.num_replays for g in (self.decode, self.prefill) if g is not None)
