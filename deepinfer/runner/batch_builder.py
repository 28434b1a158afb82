"""ScheduleOutput -> ForwardBatch: flatten the step's chunks into the model's input tensors."""

from __future__ import annotations

import torch

from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.scheduler.output import ScheduleOutput


def build_forward_batch(
    so: ScheduleOutput, block_size: int, device: torch.device
) -> tuple[ForwardBatch, list[str]]:
    """The model input for one step, and the ids of the requests whose logits come back (in order).

    Tokens of all chunks are concatenated (T rows). A chunk's token at position p goes to slot
    `block_ids[p // block_size] * block_size + p % block_size`.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    sampled_ids: list[str] = []
    max_blocks = max(len(c.block_ids) for c in so.chunks)
    block_tables = torch.zeros((len(so.chunks), max_blocks), dtype=torch.int32)
    for row, chunk in enumerate(so.chunks):
        input_ids.extend(chunk.token_ids())
        span = range(chunk.start_position, chunk.end_position)
        positions.extend(span)
        ids = chunk.block_ids
        slots.extend(ids[p // block_size] * block_size + p % block_size for p in span)
        query_start_loc.append(len(input_ids))
        context_lens.append(chunk.end_position)
        block_tables[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if chunk.sample:
            logits_indices.append(len(input_ids) - 1)
            sampled_ids.append(chunk.request_id)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        is_decode_only=all(c.num_new_tokens == 1 for c in so.chunks),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
    )
    return batch, sampled_ids
