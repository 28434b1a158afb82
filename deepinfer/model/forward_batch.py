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
    num_logits: int = 1
    """With `sample`: logits for the chunk's last `num_logits` tokens (speculative decoding
    verifies every drafted position)."""


def build_forward_batch(
    chunks: Sequence[BatchChunk], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Assemble a `ForwardBatch` from per-request chunks: host lists first, then one tensor per
    field (a decode step of B requests costs B small loops, not B tensor ops)."""
    if not chunks:
        raise ValueError("a forward batch needs at least one chunk")
    lengths = [len(c.token_ids) for c in chunks]
    if min(lengths) < 1:
        raise ValueError("every chunk needs at least one token")
    max_blocks = max(len(c.block_ids) for c in chunks)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    query_start_loc = [0]
    for c, n in zip(chunks, lengths, strict=True):
        end = c.start_position + n
        blocks = list(c.block_ids)
        if len(blocks) < -(-end // block_size):
            raise ValueError(
                f"chunk ending at position {end} needs {-(-end // block_size)} blocks, "
                f"got {len(blocks)}"
            )
        input_ids.extend(c.token_ids)
        positions.extend(range(c.start_position, end))
        slots.extend(
            blocks[p // block_size] * block_size + p % block_size
            for p in range(c.start_position, end)
        )
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        query_start_loc.append(query_start_loc[-1] + n)
    sample_rows = [
        row
        for b, c in enumerate(chunks)
        if c.sample
        for row in range(query_start_loc[b + 1] - c.num_logits, query_start_loc[b + 1])
    ]
    context_lens = [c.start_position + n for c, n in zip(chunks, lengths, strict=True)]
    int32, int64 = torch.int32, torch.int64
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=int64, device=device),
        positions=torch.tensor(positions, dtype=int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=int64, device=device),
        block_tables=torch.tensor(tables, dtype=int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=int32, device=device),
        is_decode_only=max(lengths) == 1,
        logits_indices=torch.tensor(sample_rows, dtype=int64, device=device),
    )
