"""ScheduleOutput -> ForwardBatch: the step's chunks as the model's input tensors."""

from __future__ import annotations

import torch

from deepinfer.model.forward_batch import BatchChunk, ForwardBatch, build_forward_batch
from deepinfer.scheduler.output import ScheduleOutput


def schedule_to_batch(
    so: ScheduleOutput, block_size: int, device: torch.device
) -> tuple[ForwardBatch, list[str]]:
    """The model input for one step, and the request of each row of logits that comes back, in
    order (a request verifying drafts has one row per drafted position and its last token's)."""
    chunks = [
        BatchChunk(c.token_ids(), c.start_position, c.block_ids, c.sample, c.num_logits)
        for c in so.chunks
    ]
    sampled_ids = [c.request_id for c in so.chunks if c.sample for _ in range(c.num_logits)]
    return build_forward_batch(chunks, block_size, device), sampled_ids
