"""`ForwardBatch`: everything one forward pass needs, passed explicitly (no module globals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.block_ids import int32_row


@dataclass(frozen=True)
class ForwardBatch:
    """The tokens of B requests, concatenated (T tokens in all), and where their KV lives.

    Request b owns rows `query_start_loc[b] : query_start_loc[b + 1]` of the token tensors. Its
    new tokens sit at the last positions of its context: `context_lens[b]` counts the cached
    prefix plus the new tokens. Every new token's K/V is written to `slot_mapping` before
    attention reads the blocks listed in `block_tables[b]`.

    A model whose sliding-window layers keep their KV in a pool of their own gets their slots
    and tables in `window_slot_mapping` and `window_block_tables` (None: every layer uses the
    main ones). A negative slot is not written: a replayed position whose full-layer K/V is
    already cached.
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
    """The sampling rows in chunk order, then any prompt rows (`BatchChunk.num_prompt_logits`)
    in chunk order: the rows of `num_prompt_logits` after the first `num_sampled`."""
    window_slot_mapping: torch.Tensor | None = None  # [T] int64, in the windowed pool
    window_block_tables: torch.Tensor | None = None  # [B, max_window_blocks] int32
    num_prompt_logits: int = 0
    """Rows at the end of `logits_indices` that are prompt positions, for prompt logprobs."""

    def group(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot mapping, block tables) of the full layers, or of the windowed ones."""
        if windowed and self.window_slot_mapping is not None:
            assert self.window_block_tables is not None
            return self.window_slot_mapping, self.window_block_tables
        return self.slot_mapping, self.block_tables

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
    window_block_ids: Sequence[int] = ()
    """The windowed layers' block table, where they have a pool of their own."""
    cached_until: int = 0
    """Positions before this keep their cached full-layer K/V (not written)."""
    num_prompt_logits: int = 0
    """Logits also for the chunk's first `num_prompt_logits` tokens (prompt logprobs), in
    rows after every chunk's sampling rows."""


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
    windowed = any(c.window_block_ids for c in chunks)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    window_slots: list[int] = []
    query_start_loc = [0]
    for c, n in zip(chunks, lengths, strict=True):
        end = c.start_position + n
        input_ids.extend(c.token_ids)
        positions.extend(range(c.start_position, end))
        slots.extend(_slots(c.block_ids, c.start_position, end, block_size, c.cached_until))
        if windowed:
            window_slots.extend(_slots(c.window_block_ids, c.start_position, end, block_size))
        query_start_loc.append(query_start_loc[-1] + n)
    sample_rows = [
        row
        for b, c in enumerate(chunks)
        if c.sample
        for row in range(query_start_loc[b + 1] - c.num_logits, query_start_loc[b + 1])
    ]
    prompt_rows = [
        row
        for b, c in enumerate(chunks)
        for row in range(query_start_loc[b], query_start_loc[b] + c.num_prompt_logits)
    ]
    context_lens = [c.start_position + n for c, n in zip(chunks, lengths, strict=True)]
    int32, int64 = torch.int32, torch.int64
    window = (
        (
            torch.tensor(window_slots, dtype=int64, device=device),
            _tables([c.window_block_ids for c in chunks], device),
        )
        if windowed
        else (None, None)
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=int64, device=device),
        positions=torch.tensor(positions, dtype=int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=int64, device=device),
        block_tables=_tables([c.block_ids for c in chunks], device),
        query_start_loc=torch.tensor(query_start_loc, dtype=int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=int32, device=device),
        is_decode_only=max(lengths) == 1,
        logits_indices=torch.tensor(sample_rows + prompt_rows, dtype=int64, device=device),
        window_slot_mapping=window[0],
        window_block_tables=window[1],
        num_prompt_logits=len(prompt_rows),
    )


def _slots(
    block_ids: Sequence[int], start: int, end: int, block_size: int, skip_before: int = 0
) -> list[int]:
    """Slots of positions [start, end) through a block table; -1 (not written) before
    `skip_before`."""
    if len(block_ids) < -(-end // block_size):
        raise ValueError(
            f"chunk ending at position {end} needs {-(-end // block_size)} blocks, "
            f"got {len(block_ids)}"
        )
    return [
        -1 if p < skip_before else block_ids[p // block_size] * block_size + p % block_size
        for p in range(start, end)
    ]


def build_decode_batch(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """`build_forward_batch` of B one-token sampling chunks (a plain decode step: no drafts, no
    windowed pool, nothing cached ahead), without a `BatchChunk` per request: the same batch."""
    if not token_ids:
        raise ValueError("a forward batch needs at least one chunk")
    pairs = zip(block_tables, positions, strict=True)
    try:
        slots = [t[p // block_size] * block_size + p % block_size for t, p in pairs]
    except IndexError:
        raise ValueError("a chunk's block table does not cover its position") from None
    n = len(token_ids)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    int32, int64 = torch.int32, torch.int64
    return ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=int64, device=device),
        positions=torch.tensor(positions, dtype=int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=int64, device=device),
        block_tables=_tables(block_tables, device),
        query_start_loc=torch.arange(n + 1, dtype=int32, device=device),
        context_lens=torch.tensor([p + 1 for p in positions], dtype=int32, device=device),
        is_decode_only=True,
        logits_indices=rows,
    )


def _tables(tables: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """Block tables as one [B, max_blocks] int32 tensor, padded with the null block: a join of
    the rows' int32 bytes (a `BlockIds` carries its own)."""
    width = max(map(len, tables))
    pad = bytes(4 * width)
    try:  # a decode step's tables are all `BlockIds`: their bytes without a call a row
        rows = [t.int32 for t in tables]  # type: ignore[attr-defined]
    except AttributeError:
        rows = [int32_row(t) for t in tables]
    flat = bytearray().join([r + pad[len(r) :] for r in rows])
    data = torch.frombuffer(flat, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32)
    table = data.view(len(tables), width)
    on_cpu = torch.device(device).type == "cpu"  # `to` would still dispatch (and drop the GIL)
    return table if on_cpu else table.to(device)
