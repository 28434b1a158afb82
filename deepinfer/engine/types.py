"""What the embedding API hands back: one `GenerationOutput` per delivered delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.kv_transfer.stats import KVTransferStats
from deepinfer.message import message
from deepinfer.model.experts.placement import ExpertParallelStats
from deepinfer.outputs import PromptLogprob, SampledToken
from deepinfer.request import FinishReason
from deepinfer.scheduler.admission import PrefillCounts
from deepinfer.scheduler.prefill_types import PlannerStats
from deepinfer.scheduler.speculative import SpeculativeCounts
from deepinfer.tiers.stats import DiskTierStats, HostTierStats


@message
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache (not recomputed), all tiers."""
    disk_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded from the disk tier."""
    host_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded from the host-RAM tier."""
    remote_cached_tokens: int = 0
    """Of `cached_tokens`, those pulled from another replica (`--kv-transfer`)."""
    accepted_prediction_tokens: int = 0
    """Of the request's prediction, the tokens verified as drafts and kept so far."""
    rejected_prediction_tokens: int = 0
    """Of the request's prediction, the others (all of it until the answer ends)."""

    @property
    def device_cached_tokens(self) -> int:
        """Of `cached_tokens`, those found in device blocks already."""
        return (
            self.cached_tokens
            - self.disk_cached_tokens
            - self.host_cached_tokens
            - self.remote_cached_tokens
        )


@message
class GenerationOutput:
    """New output of one request since the previous one (deltas merge for slow readers)."""

    request_id: str
    text: str
    """New text; never half a UTF-8 character, never any part of a matched stop string."""
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    """The stop string or stop token id that ended generation, if any."""
    usage: Usage
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    """With the first output of a request asking for them: the logprobs of its prompt tokens
    after the first (`SamplingParams.prompt_logprobs`); None in every other output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class WorkerStats:
    name: str
    device: str
    num_threads: int | None
    busy_fraction: float
    """Share of the last 10 s this worker spent running steps."""
    num_steps: int
    busy_s_total: float


@dataclass(frozen=True)
class HandoffStats:
    """KV copies from the prefill pool to the decode pool (separate device groups), since start."""

    num_handoffs: int = 0
    num_blocks: int = 0
    seconds_total: float = 0.0
    """Ordered to complete, including the wait for the transfer thread."""

    def add(self, num_blocks: int, seconds: float) -> HandoffStats:
        return HandoffStats(
            self.num_handoffs + 1, self.num_blocks + num_blocks, self.seconds_total + seconds
        )


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_blocks_used: int
    max_model_len: int
    disk: DiskTierStats | None = None
    """The disk tier's counters, when it is enabled."""
    workers: tuple[WorkerStats, ...] = ()
    """One record per worker (prefill and decode, or the colocated one)."""
    prefill: PlannerStats | None = None
    """The prefill planner's queues per bucket and step-time predictions (disaggregated)."""
    host: HostTierStats | None = None
    """The host-RAM tier's counters, when it is enabled."""
    decode_blocks_total: int = 0
    """Blocks of the decode pool, when the decode worker has its own device group (else 0:
    the one pool above serves both)."""
    decode_blocks_used: int = 0
    window_blocks_total: int = 0
    """Blocks of the sliding-window layers' own pool (`--window-kv window`; else 0)."""
    window_blocks_used: int = 0
    handoffs: HandoffStats = HandoffStats()
    num_failed_steps: int = 0
    """Steps that raised since start; each failed only its own requests."""
    num_failed_requests: int = 0
    """Requests ended with an internal error (a failed step, or a failed delivery)."""
    prefill_counts: PrefillCounts = field(default_factory=PrefillCounts)
    """Prompt tokens computed, and those a shared prefix in flight saved."""
    speculative: SpeculativeCounts = field(default_factory=SpeculativeCounts)
    """Draft tokens verified and accepted (speculative decoding)."""
    expert_load: tuple[tuple[int, ...], ...] = ()
    """Mixture of Experts: per layer, tokens routed to each expert since start (a token counts
    once per expert it is routed to; a dense layer's entry is empty); () for a dense model."""
    expert_parallel: ExpertParallelStats | None = None
    """Expert-parallel groups and the balancer's work (None: every expert in one place)."""
    kv_events_dropped: int | None = None
    """KV events dropped since start because the publisher fell behind (None: events off)."""
    kv_transfer: KVTransferStats | None = None
    """KV transfers with other replicas (None: `--kv-transfer off`)."""
