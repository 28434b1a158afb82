"""Building the scheduler: one colocated lane, or the disaggregated prefill and decode lanes with
the prefill planner's time budget, length buckets and cost model."""

from __future__ import annotations

import torch

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import Config
from deepinfer.scheduler.cost_model import (
    DECODE_PRIOR_SHAPES,
    CostCoefficients,
    CostModelConfig,
    StepCostModel,
)
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.draft_gate import DraftGate
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.prefill_types import PrefillPlannerConfig
from deepinfer.scheduler.protocol import EngineScheduler
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.scheduler.speculative import build_proposer

CPU_STEP_MS = 1000.0
"""The CPU prefill step budget (reading the weights alone takes ~0.1-0.2 s a step)."""
CPU_BF16_STEP_MS = 2000.0
"""The CPU prefill step budget where long products run as bf16 tiles (see `planner_config`)."""
CPU_COST_PRIOR = CostCoefficients(step_s=0.01, token_s=6e-3, attention_s=5e-8)
"""A prefill step on one CPU core, roughly (SmolLM2-135M): the model refines it within steps."""


def build_scheduler(
    config: Config,
    kv: KVCacheManager,
    max_len: int,
    device: torch.device,
    decode_kv: KVCacheManager | None,
    bf16_prefill: bool = False,
    mtp: bool = False,
) -> EngineScheduler:
    """The colocated scheduler (`--colocated`), else the disaggregated one; `decode_kv` is the
    decode pool when it is separate (None: decode uses `kv`); `bf16_prefill`: the model takes
    long chunks' products as bf16 tiles (see `planner_config`); `mtp`: the decode runner
    drafts with the model's MTP layer."""
    if config.workers.colocated:
        return Scheduler(config.scheduler, kv, max_len, build_drafter(config, device, mtp))
    return DisaggScheduler(
        config.scheduler,
        planner_config(config, device, bf16_prefill),
        kv,
        max_len,
        StepCostModel(CostModelConfig(prior=cost_prior(device))),
        decode_kv,
        build_drafter(config, device, mtp),
    )


def build_drafter(config: Config, device: torch.device, mtp: bool = False) -> Drafter:
    """Speculative decoding's drafter: the configured proposer (None: `--speculative none`,
    where only requests with a prediction draft; `mtp`: the runner has the model's MTP layer,
    which `auto` chooses from too) and its gate."""
    spec = config.speculative
    proposer = build_proposer(spec, mtp)
    cost = StepCostModel(
        CostModelConfig(
            prior=decode_cost_prior(device), prior_weight=0.5, prior_shapes=DECODE_PRIOR_SHAPES
        )
    )
    gate = DraftGate(
        cost,
        proposer.num_signals if proposer is not None else 1,
        spec.num_draft_tokens,
        enabled=spec.speculative_gate == "on",
    )
    return Drafter(proposer, gate, spec.num_draft_tokens)


CPU_DECODE_COST_PRIOR = CostCoefficients(
    step_s=3e-3, token_s=9e-4, attention_s=7e-7, kv_token_s=0.0
)
"""A decode step on two CPU cores (SmolLM2-135M, fitted to measured steps of 1 to 125 rows):
most of a one-row step is reading the weights once; each more query row (a request, or a
draft to verify) adds its arithmetic, and its attention reads its whole context (the one-row
kernel: 7e-7 s a key, against a prefill chunk's fraction of that)."""
CUDA_DECODE_COST_PRIOR = CostCoefficients(
    step_s=5e-3, token_s=2e-5, attention_s=1e-10, kv_token_s=1e-8
)


def decode_cost_prior(device: torch.device) -> CostCoefficients:
    return CPU_DECODE_COST_PRIOR if device.type == "cpu" else CUDA_DECODE_COST_PRIOR


def cost_prior(device: torch.device) -> CostCoefficients:
    return CPU_COST_PRIOR if device.type == "cpu" else CostModelConfig().prior


def planner_config(
    config: Config, device: torch.device, bf16_prefill: bool = False
) -> PrefillPlannerConfig:
    """The prefill planner's budget (50 ms on CUDA, 1 s on CPU, 2 s where the model takes long
    chunks' products as bf16 tiles, unless configured), buckets (shorter ones weighted more)
    and batch bounds. The tiles pay from 256 rows, which a 1.5B model's 1 s chunk (about 120
    tokens on 2 cores) never reaches: its 2 s chunks are some 350 tokens, and a 4.6k-token
    prompt fills 1.47x faster than in 1 s chunks of the int8 kernel (bench/RESULTS.md)."""
    w = config.workers
    cpu_ms = CPU_BF16_STEP_MS if bf16_prefill else CPU_STEP_MS
    step_ms = w.prefill_step_ms or (50.0 if device.type == "cuda" else cpu_ms)
    num_buckets = len(w.prefill_buckets) + 1
    return PrefillPlannerConfig(
        step_budget_ms=step_ms,
        boundaries=w.prefill_buckets,
        bucket_weights=tuple(float(2 ** max(0, 2 - i)) for i in range(num_buckets)),
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=w.prefill_max_batched_tokens,
        chunk_align_tokens=config.cache.block_size,
    )
