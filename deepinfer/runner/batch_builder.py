"""ScheduleOutput -> ForwardBatch: the step's chunks as the model's input tensors."""

from __future__ import annotations

import torch

from deepinfer.model.forward_batch import (
    BatchChunk,
    ForwardBatch,
    build_decode_batch,
    build_forward_batch,
)
from deepinfer.request import Request
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput


def schedule_to_batch(
    so: ScheduleOutput, block_size: int, device: torch.device
) -> tuple[ForwardBatch, list[str]]:
    """The model input for one step, and the request of each row of logits that comes back, in
    order (a request verifying drafts has one row per drafted position and its last token's)."""
    if so.plain_decodes or all(map(_plain_decode, so.chunks)):
        requests = [c.request for c in so.chunks]
        return decode_batch(so.chunks, requests, block_size, device), [
            r.request_id for r in requests
        ]
    chunks = [part for c in so.chunks for part in _batch_chunks(c)]
    sampled_ids = [c.request_id for c in so.chunks if c.sample for _ in range(c.num_logits)]
    return build_forward_batch(chunks, block_size, device), sampled_ids


def _plain_decode(chunk: ScheduledChunk) -> bool:
    """One token, sampled, no drafts, one pool, nothing cached ahead of it."""
    return (
        chunk.num_new_tokens == 1
        and chunk.sample
        and not chunk.num_worker_drafts
        and not chunk.window_block_ids
        and not chunk.cached_until
    )


def decode_batch(
    chunks: tuple[ScheduledChunk, ...],
    requests: list[Request],
    block_size: int,
    device: torch.device,
) -> ForwardBatch:
    """The batch of plain decodes (`requests[i]` is `chunks[i].request`): a sampled one-token
    chunk reaches its request's last token, so that is each row's input."""
    positions = [c.start_position for c in chunks]
    tokens = [o[-1] if (o := r.output_token_ids) else r.prompt_token_ids[-1] for r in requests]
    tables = [c.block_ids for c in chunks]
    return build_decode_batch(tokens, positions, tables, block_size, device)


def _batch_chunks(chunk: ScheduledChunk) -> list[BatchChunk]:
    """A chunk as the model computes it. A decode verifying drafts becomes one decode row per
    position, each attending to the positions up to its own (their KV is written before any
    row attends, layer by layer): a step of decodes and verifications stays a decode step (the
    decode kernels, no switch to the prefill path for a few extra rows), and each row is
    computed exactly as the plain decode at its position would be."""
    tokens, start = chunk.token_ids(), chunk.start_position
    window, cached_until = chunk.window_block_ids, chunk.cached_until
    if not chunk.draft_token_ids:
        sample, num_logits, num_prompt = chunk.sample, chunk.num_logits, chunk.num_prompt_logits
        whole = BatchChunk(
            tokens, start, chunk.block_ids, sample, num_logits, window, cached_until, num_prompt
        )
        return [whole]
    return [
        BatchChunk([t], start + j, chunk.block_ids, True, 1, window, cached_until)
        for j, t in enumerate(tokens)
    ]
