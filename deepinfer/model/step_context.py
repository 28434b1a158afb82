"""`StepContext`: what every layer of one forward pass shares, and how a pass builds it: the
attention plans (one per KV pool: the full layers', and the sliding-window layers' where they
keep a pool of their own) and the RoPE tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.attention.paged_attention_torch import PagedAttentionPlan
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches


@dataclass(frozen=True)
class StepContext:
    """What every layer of one forward pass shares (built once per pass, never stored)."""

    batch: ForwardBatch
    ops: AttentionBackend
    cos_sin: torch.Tensor  # [P, D]
    plan: PagedAttentionPlan | None
    """The backend's per-step attention plan (see `AttentionBackend.plan_paged_attention`)."""
    cos_sin_local: torch.Tensor  # [P, D]
    """The windowed layers' RoPE table (`cos_sin` itself when they share the full layers')."""
    window_plan: PagedAttentionPlan | None = None
    """The windowed layers' plan, where their KV has a pool of its own (else they use `plan`)."""

    def attention_plan(self, windowed: bool) -> PagedAttentionPlan | None:
        own_pool = windowed and self.batch.window_block_tables is not None
        return self.window_plan if own_pool else self.plan


def step_context(
    batch: ForwardBatch,
    ops: AttentionBackend,
    arch: ModelArch,
    kv_caches: KVCaches,
    cos_sin: torch.Tensor,
    cos_sin_local: torch.Tensor,
) -> StepContext:
    """The step's attention plans (one per KV pool) and RoPE tables."""
    starts, lens = batch.query_start_loc, batch.context_lens
    windows = [arch.window(i) for i in range(arch.num_layers)]
    full = windows.index(None) if None in windows else 0
    plan = ops.plan_paged_attention(batch.block_tables, starts, lens, kv_caches[full][0])
    window_plan = None
    if batch.window_block_tables is not None:
        window_cache = kv_caches[next(i for i, w in enumerate(windows) if w)][0]
        window_plan = ops.plan_paged_attention(
            batch.window_block_tables, starts, lens, window_cache
        )
    return StepContext(batch, ops, cos_sin, plan, cos_sin_local, window_plan)
