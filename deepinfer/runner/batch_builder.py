"""ScheduleOutput -> ForwardBatch: the step's chunks as the model's input tensors."""

from __future__ import annotations

import torch

from deepinfer.model.forward_batch import BatchChunk, ForwardBatch, build_forward_batch
from deepinfer.scheduler.output import ScheduleOutput


def schedule_to_batch(
    so: ScheduleOutput, block_size: int, device: torch.device
) -> tuple[ForwardBatch, list[str]]:
    """The model input for one step, and the ids of the requests whose logits come back (in order)."""
    chunks = [
        BatchChunk(c.token_ids(), c.start_position, c.block_ids, sample=c.sample) for c in so.chunks
    ]
    sampled_ids = [c.request_id for c in so.chunks if c.sample]
    return build_forward_batch(chunks, block_size, device), sampled_ids
