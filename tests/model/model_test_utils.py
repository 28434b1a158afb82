"""Helpers for the model tests: a sequential block allocator and paged runs of a model."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches


class SequentialBlocks:
    """Hands out block ids 1, 2, 3... in order (block 0 stays unused, as padding)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_block = 1
        self.tables: dict[int, list[int]] = {}

    def table(self, request: int, num_tokens: int) -> list[int]:
        blocks = self.tables.setdefault(request, [])
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.next_block)
            self.next_block += 1
        return list(blocks)


def _device(model: Any) -> torch.device:
    return model.norm.weight.device  # type: ignore[no-any-return]


def bind_fresh_caches(model: Any, num_blocks: int, block_size: int) -> None:
    """Fresh paged caches on the model's own device (CPU, or CUDA when a test puts it there)."""
    dtype = model.norm.weight.dtype
    caches = allocate_kv_caches(model.arch, num_blocks, block_size, dtype, _device(model))
    model.bind_kv_caches(caches)


def run_step(
    model: Any,
    blocks: SequentialBlocks,
    pieces: list[tuple[int, list[int], int]],
    all_rows: bool = False,
    columns: int | None = None,
) -> list[torch.Tensor]:
    """One forward over (request, token_ids, start_position) pieces; logits per piece.

    With `all_rows` every token's logits come back ([n, V] per piece); else the last token's ([V]).
    Logits come back on the CPU, whatever the model's device; with `columns`, only the first
    `columns` of the vocabulary (a large vocabulary's logits of long prompts take gigabytes).
    """
    chunks = [
        BatchChunk(tokens, start, blocks.table(req, start + len(tokens)))
        for req, tokens, start in pieces
    ]
    device = _device(model)
    batch = build_forward_batch(chunks, blocks.block_size, device)
    if all_rows:
        rows = torch.arange(batch.num_tokens, device=device)
        batch = dataclasses.replace(batch, logits_indices=rows)
    logits = model(batch).float().cpu()
    if columns is not None:
        logits = logits[:, :columns].clone()
    if not all_rows:
        return list(logits)
    bounds = batch.query_start_loc.tolist()
    return [logits[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def chunked_prefill_logits(
    model: Any,
    blocks: SequentialBlocks,
    prompts: list[list[int]],
    chunk: int,
    columns: int | None = None,
) -> list[torch.Tensor]:
    """All-position logits of each prompt, prefilled `chunk` tokens per request per step, batched."""
    outs: list[list[torch.Tensor]] = [[] for _ in prompts]
    start = 0
    while start < max(len(p) for p in prompts):
        pieces = [
            (i, p[start : start + chunk], start) for i, p in enumerate(prompts) if start < len(p)
        ]
        for (i, _, _), logits in zip(
            pieces, run_step(model, blocks, pieces, all_rows=True, columns=columns), strict=True
        ):
            outs[i].append(logits)
        start += chunk
    return [torch.cat(o) for o in outs]


def prefill_then_decode_logits(
    model: Any,
    blocks: SequentialBlocks,
    prompts: list[list[int]],
    prefill_lens: list[int],
    columns: int | None = None,
) -> list[torch.Tensor]:
    """Prefill each prompt's first tokens, then feed the rest one token per step, all requests in
    one decode batch; returns the logits of positions prefill_len-1 .. len-1 per prompt."""
    outs = [
        [logits]
        for logits in run_step(
            model,
            blocks,
            [(i, p[:n], 0) for i, (p, n) in enumerate(zip(prompts, prefill_lens, strict=True))],
            columns=columns,
        )
    ]
    step = 0
    while True:
        pieces = [
            (i, [p[n + step]], n + step)
            for i, (p, n) in enumerate(zip(prompts, prefill_lens, strict=True))
            if n + step < len(p)
        ]
        if not pieces:
            break
        for (i, _, _), logits in zip(
            pieces, run_step(model, blocks, pieces, columns=columns), strict=True
        ):
            outs[i].append(logits)
        step += 1
    return [torch.stack(o) for o in outs]


def greedy_decode(
    model: Any, blocks: SequentialBlocks, prompts: list[list[int]], num_new: int
) -> list[list[int]]:
    """Greedy continuations of all prompts, decoded together one token per step."""
    first = run_step(model, blocks, [(i, p, 0) for i, p in enumerate(prompts)])
    outputs = [[int(logits.argmax())] for logits in first]
    for step in range(1, num_new):
        pieces = [
            (i, [out[-1]], len(p) + step - 1)
            for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
        ]
        for out, logits in zip(outputs, run_step(model, blocks, pieces), strict=True):
            out.append(int(logits.argmax()))
    return outputs
