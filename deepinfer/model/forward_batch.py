"""`ForwardBatch`: everything one forward pass needs, passed explicitly (no module globals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """The tokens of B requests, concatenated (T tokens in all), and where their KV lives.

    Request b owns rows `query_start_loc[b] : query_start_loc[b + 1]` of the token tensors. Its
    new tokens sit at the last positions of its context: `context_lens[b]` counts the cached
    prefix plus the new tokens. Every new token's K/V is written to `slot_mapping` before
    attention reads the blocks listed in `block_tables[b]`.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    is_decode_only: bool
    """Every request has exactly one new token: use paged decode attention."""
    logits_indices: torch.Tensor  # [B_sample] int64, token rows to compute logits for

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass(frozen=True)
class BatchChunk:
    """One request's share of a step: `token_ids` computed at positions from `start_position`."""

    token_ids: Sequence[int]
    start_position: int
    """Tokens before this already have KV in the first blocks of `block_ids`."""
    block_ids: Sequence[int]
    """The request's block table, covering at least start_position + len(token_ids) tokens."""
    sample: bool = True
    """Compute logits for the chunk's last token."""


def build_forward_batch(
    chunks: Sequence[BatchChunk], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Assemble a `ForwardBatch` from per-request chunks (vectorized over tokens)."""
    if not chunks:
        raise ValueError("a forward batch needs at least one chunk")
    lengths = [len(c.token_ids) for c in chunks]
    if min(lengths) < 1:
        raise ValueError("every chunk needs at least one token")
    for c in chunks:
        needed = -(-(c.start_position + len(c.token_ids)) // block_size)
        if len(c.block_ids) < needed:
            raise ValueError(
                f"chunk ending at position {c.start_position + len(c.token_ids)} needs "
                f"{needed} blocks, got {len(c.block_ids)}"
            )
    starts = torch.tensor([c.start_position for c in chunks], dtype=torch.int64)
    lens = torch.tensor(lengths, dtype=torch.int64)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=query_start_loc[1:])
    request_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lens)  # [T]
    offsets = torch.arange(int(lens.sum())) - query_start_loc[:-1][request_of_token]
    positions = starts[request_of_token] + offsets  # [T]
    max_blocks = max(len(c.block_ids) for c in chunks)
    block_tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int64)
    for b, c in enumerate(chunks):
        block_tables[b, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int64)
    block_ids = block_tables[request_of_token, positions // block_size]  # [T]
    slot_mapping = block_ids * block_size + positions % block_size
    sample_rows = [int(query_start_loc[b + 1]) - 1 for b, c in enumerate(chunks) if c.sample]
    input_ids = [t for c in chunks for t in c.token_ids]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        context_lens=(starts + lens).to(device=device, dtype=torch.int32),
        is_decode_only=max(lengths) == 1,
        logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )
