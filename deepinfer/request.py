"""Request types shared by every layer: sampling parameters, request state, finish reasons.

A leaf module: it imports nothing from deepinfer but `errors`.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from deepinfer.errors import InvalidRequestError


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An end-of-turn/stop token or a stop string."""
    LENGTH = "length"
    """max_tokens reached, or the context is full."""
    ABORT = "abort"
    """Aborted by the caller (disconnect, cancel, abort by id)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Same seed, same output (for the same prompt and parameters)."""
    stop: tuple[str, ...] = ()
    """Stop strings; the matched string is never part of the output."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation, besides the model's end-of-turn."""
    ignore_eos: bool = False
    """Keep generating past end-of-turn tokens (benchmarks)."""
    min_tokens: int = 0
    """End-of-turn and stop tokens are suppressed until this many tokens are generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""

    def __post_init__(self) -> None:
        _check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{field_name} {message}", param=field_name)


def _check_sampling(p: SamplingParams) -> None:
    finite = all(
        math.isfinite(v)
        for v in (
            p.temperature,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
    )
    _check(finite, "sampling", "parameters must be finite numbers")
    _check(p.max_tokens >= 1, "max_tokens", f"must be at least 1, got {p.max_tokens}")
    _check(
        0.0 <= p.temperature <= 100.0, "temperature", f"must be in [0, 100], got {p.temperature}"
    )
    _check(0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {p.top_k}")
    _check(0.0 <= p.min_p <= 1.0, "min_p", f"must be in [0, 1], got {p.min_p}")
    _check(p.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
    _check(-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
    _check(-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
    _check(p.min_tokens >= 0, "min_tokens", "must be >= 0")
    _check(p.min_tokens <= p.max_tokens, "min_tokens", "must not exceed max_tokens")
    _check(p.logprobs is None or 0 <= p.logprobs <= 20, "logprobs", "must be in [0, 20]")
    _check(
        all(isinstance(s, str) and s for s in p.stop), "stop", "entries must be non-empty strings"
    )
    _check(len(p.stop) <= 16, "stop", "may hold at most 16 strings")
    _check(all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "must be non-negative")


@dataclass
class Request:
    """One generation's state, owned and mutated by the scheduler (runner reads only).

    Invariant: `num_computed_tokens <= len(all_token_ids)`; the KV of the first
    `num_computed_tokens` tokens is in the blocks the cache manager holds for this request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    """Mixed into the first block hash so tenants never share prefixes."""
    retention: str | None = None
    """Disk-cache retention class (`agent`, `chat`, `none`); None: the server default."""
    num_disk_cached_tokens: int = 0
    """Prompt tokens whose KV was loaded from the disk tier on submit."""
    num_host_cached_tokens: int = 0
    """Prompt tokens whose KV was loaded from the host-RAM tier on submit."""
    arrival_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission; -1 until admitted."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (unless ignore_eos, or min_tokens not yet reached)."""
        extra = frozenset(self.sampling.stop_token_ids)
        return extra if self.sampling.ignore_eos else self.eos_token_ids | extra
