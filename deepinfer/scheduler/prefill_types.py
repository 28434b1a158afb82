"""Messages and configuration of the prefill planner (`prefill_planner.PrefillPlanner`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.errors import ConfigError
from deepinfer.scheduler.buckets import DEFAULT_BOUNDARIES
from deepinfer.scheduler.cost_model import ChunkShape, CostModelStats


class PrefillSource(Protocol):
    """What the planner needs to know of a request (a `Request` qualifies as is)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV must exist before the request samples (prompt, plus outputs when
        recomputing after preemption)."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV exists already (computed, or a prefix-cache hit)."""
        ...


@dataclass(frozen=True)
class PrefillView:
    """A lightweight `PrefillSource` (tests, and callers that keep requests elsewhere)."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class PrefillPlannerConfig:
    step_budget_ms: float = 50.0
    """Target duration of one prefill step (`--prefill-step-ms`); chunks are sized to fit it."""
    boundaries: tuple[int, ...] = DEFAULT_BOUNDARIES
    """Upper bounds (inclusive) of uncached-token buckets; one more bucket holds the rest."""
    bucket_weights: tuple[float, ...] = (4.0, 2.0, 1.0, 1.0)
    """Guaranteed share of each step for each non-empty bucket, relative to the other
    non-empty buckets (one weight per bucket, shortest first)."""
    max_num_seqs: int = 64
    """Most requests with a chunk in one step."""
    max_num_batched_tokens: int = 16384
    """Most new tokens in one step (activation memory), whatever the time budget allows."""
    chunk_align_tokens: int = 16
    """Chunks that do not finish their request end on a multiple of this (the KV block size),
    so chunk boundaries fall on block boundaries."""
    max_wait_steps: int = 8
    """A non-empty bucket not served for this many steps gets one aligned chunk first
    (a backstop: shares alone serve every bucket whenever one chunk fits its share)."""

    def __post_init__(self) -> None:
        if self.step_budget_ms <= 0:
            raise ConfigError(f"prefill step budget must be positive, got {self.step_budget_ms} ms")
        if len(self.bucket_weights) != len(self.boundaries) + 1:
            raise ConfigError(
                f"{len(self.boundaries)} bucket boundaries need {len(self.boundaries) + 1} "
                f"bucket weights, got {len(self.bucket_weights)}"
            )
        if min(self.bucket_weights) <= 0:
            raise ConfigError(f"bucket weights must be positive, got {self.bucket_weights}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.chunk_align_tokens) < 1:
            raise ConfigError("prefill max_num_seqs, max_num_batched_tokens, align must be >= 1")
        if self.max_num_batched_tokens < self.chunk_align_tokens:
            raise ConfigError("prefill max_num_batched_tokens must be at least chunk_align_tokens")
        if self.max_wait_steps < 1:
            raise ConfigError(f"prefill max_wait_steps must be >= 1, got {self.max_wait_steps}")

    @property
    def step_budget_s(self) -> float:
        return self.step_budget_ms / 1e3


@dataclass(frozen=True)
class PlannedChunk:
    """Compute `num_new_tokens` tokens of a request from `start_position` (all earlier tokens
    have KV). `is_last`: the chunk completes the request's prefill."""

    request_id: str
    start_position: int
    num_new_tokens: int
    bucket: int
    is_last: bool

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_new_tokens

    @property
    def shape(self) -> ChunkShape:
        return ChunkShape(self.num_new_tokens, self.start_position)


@dataclass(frozen=True)
class PrefillPlan:
    step: int
    chunks: tuple[PlannedChunk, ...]
    """At most one chunk per request; shorter buckets first."""
    predicted_s: float
    """The cost model's prediction for these chunks when planned."""
    budget_s: float
    forced: bool = False
    """True when a starvation or progress guard added a chunk regardless of the budget (the
    only case where `predicted_s` may exceed `budget_s`)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def shapes(self) -> tuple[ChunkShape, ...]:
        return tuple(c.shape for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class PlannerStats:
    """Observability record: queues per bucket, and predicted against measured step time."""

    step: int
    bucket_labels: tuple[str, ...]
    queue_depths: tuple[int, ...]
    """Requests queued per bucket (including ones part-way through their chunks)."""
    queued_tokens: tuple[int, ...]
    """Tokens still to compute per bucket."""
    head_wait_steps: tuple[int, ...]
    """Steps the head of each bucket has waited for its first chunk (0 once planned or empty)."""
    num_steps_observed: int
    last_predicted_s: float
    last_measured_s: float
    mean_abs_rel_error: float
    """Mean over observed steps of |predicted - measured| / measured (plan-time predictions)."""
    num_steps_over_budget: int
    """Observed steps whose measured time exceeded the budget by more than 20%."""
    cost: CostModelStats = field(repr=False)
