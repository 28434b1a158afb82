"""Request types shared by every layer: sampling parameters, request state, finish reasons.

A leaf module: it imports nothing from deepinfer but `errors`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import time
from dataclasses import dataclass, field

from deepinfer.errors import InvalidRequestError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (argmax): dividing logits by them would overflow float32."""

MAX_TOKEN_ID = 2**31 - 1
"""Token ids (stop_token_ids) and top_k above this are refused: they must fit an int32."""

REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Divides or multiplies logits: outside this range float32 logits overflow or collapse to 0."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""A seed must fit 64 bits (signed or unsigned)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An end-of-turn/stop token or a stop string."""
    LENGTH = "length"
    """max_tokens reached, or the context is full."""
    ABORT = "abort"
    """Aborted by the caller (disconnect, cancel, abort by id)."""
    ERROR = "error"
    """A step holding the request failed; its stream ends with an error, never this reason."""


class StructuredKind(enum.StrEnum):
    """What a `StructuredSpec.source` holds."""

    JSON_SCHEMA = "json_schema"
    """A JSON schema (JSON text); the output is one instance of it."""
    JSON_OBJECT = "json_object"
    """Any JSON object (`source` is empty)."""
    REGEX = "regex"
    """A regular expression (Rust `regex` syntax) the whole output matches."""
    CHOICE = "choice"
    """A JSON array of strings; the output is one of them."""
    GRAMMAR = "grammar"
    """A Lark grammar (llguidance's dialect): fixed text around JSON schemas (`%json {...}`),
    regexes and rules, e.g. a tool call's wrapper around its arguments' schema."""


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the whole output: every sampled token keeps it inside this grammar."""

    kind: StructuredKind
    source: str = ""
    param: str = "structured"
    """The request field it came from, named by errors (e.g. `response_format`)."""
    parts: tuple[StructuredSpec, ...] = ()
    """Pieces of `source` checked on their own before it (each forced tool's schema), so that a
    piece the grammar library refuses is reported under its own field."""

    def __post_init__(self) -> None:
        _check(isinstance(self.kind, StructuredKind), self.param, "has an unknown kind")
        _check(
            bool(self.source) or self.kind is StructuredKind.JSON_OBJECT,
            self.param,
            f"needs a non-empty {self.kind.value}",
        )


LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""OpenAI's range for a `logit_bias` entry."""


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
    """0 (or anything below `GREEDY_TEMPERATURE`) means greedy."""
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
    """Stop strings; the matched string is not part of the output (but see
    `include_stop_str_in_output`)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation, besides the model's end-of-turn."""
    ignore_eos: bool = False
    """Keep generating past end-of-turn tokens (benchmarks)."""
    min_tokens: int = 0
    """End-of-turn and stop tokens are suppressed until this many tokens are generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob given the tokens before it, its rank, and this many
    top alternatives (0..20); computed from the raw logits, every prompt position recomputed
    (no prefix-cache hit for such a request)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before anything else."""
    structured: StructuredSpec | None = None
    """Keep the output inside this grammar (structured output); None: unconstrained."""
    shown_token_ids: tuple[int, ...] = ()
    """Control tokens written into the output text as a mark no decoded text holds, instead of
    being dropped: a tool-call parser's markers (`text/detokenizer.py`, `CONTROL_MARK`)."""

    def __post_init__(self) -> None:
        _check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def with_turn_stops(self, turn_stops: tuple[str, ...]) -> SamplingParams:
        """These parameters for a chat answer: the recipe's `turn_stops` after the client's
        stop strings, so a transcript's answer ends where its turn does (not under
        `ignore_eos`, which asks for every token up to `max_tokens`)."""
        extra = tuple(s for s in turn_stops if s not in self.stop)
        if not extra or self.ignore_eos:
            return self
        return dataclasses.replace(self, stop=self.stop + extra)

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
    """Every parameter within the range where the sampler's float32 arithmetic is sound."""
    floats = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
    }
    for name, value in floats.items():
        _check(math.isfinite(value), name, f"must be a finite number, got {value}")
    _check(p.max_tokens >= 1, "max_tokens", f"must be at least 1, got {p.max_tokens}")
    _check(
        0.0 <= p.temperature <= 100.0, "temperature", f"must be in [0, 100], got {p.temperature}"
    )
    _check(0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p}")
    _check(
        0 <= p.top_k <= MAX_TOKEN_ID,
        "top_k",
        f"must be in [0, {MAX_TOKEN_ID}] (0 disables it), got {p.top_k}",
    )
    _check(0.0 <= p.min_p <= 1.0, "min_p", f"must be in [0, 1], got {p.min_p}")
    low, high = REPETITION_PENALTY_RANGE
    _check(
        low <= p.repetition_penalty <= high,
        "repetition_penalty",
        f"must be in [{low}, {high}] (1 disables it), got {p.repetition_penalty}",
    )
    for name in ("presence_penalty", "frequency_penalty"):
        _check(-2.0 <= floats[name] <= 2.0, name, f"must be in [-2, 2], got {floats[name]}")
    _check(p.min_tokens >= 0, "min_tokens", f"must be >= 0, got {p.min_tokens}")
    _check(p.min_tokens <= p.max_tokens, "min_tokens", "must not exceed max_tokens")
    _check(p.logprobs is None or 0 <= p.logprobs <= 20, "logprobs", "must be in [0, 20]")
    _check(
        p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= 20,
        "prompt_logprobs",
        "must be in [0, 20]",
    )
    low_seed, high_seed = SEED_RANGE
    _check(
        p.seed is None or low_seed <= p.seed <= high_seed,
        "seed",
        f"must fit 64 bits: in [{low_seed}, {high_seed}]",
    )
    _check(
        all(isinstance(s, str) and s for s in p.stop), "stop", "entries must be non-empty strings"
    )
    _check(
        all(0 <= t <= MAX_TOKEN_ID for t in p.stop_token_ids),
        "stop_token_ids",
        f"entries must be in [0, {MAX_TOKEN_ID}]",
    )
    _check_logit_bias(p.logit_bias)


def _check_logit_bias(entries: tuple[tuple[int, float], ...]) -> None:
    low, high = LOGIT_BIAS_RANGE
    for token_id, bias in entries:
        _check(
            0 <= token_id <= MAX_TOKEN_ID,
            "logit_bias",
            f"token ids must be in [0, {MAX_TOKEN_ID}], got {token_id}",
        )
        _check(
            math.isfinite(bias) and low <= bias <= high,
            "logit_bias",
            f"biases must be in [{low:g}, {high:g}], got {bias} for token {token_id}",
        )


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
    num_remote_cached_tokens: int = 0
    """Prompt tokens whose KV was pulled from another replica on submit (`kv_transfer`)."""
    hold_kv: bool = False
    """Keep the prompt's blocks for another replica to pull once finished (`do_remote_decode`)."""
    predicted_token_ids: tuple[int, ...] = ()
    """The client's prediction of the output (OpenAI's `prediction`), drafted from
    (`scheduler/prediction.py`); the output is the model's own either way."""
    num_accepted_prediction_tokens: int = 0
    """Tokens of the prediction verified as drafts and kept."""
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

    def token_span(self, lo: int, hi: int) -> list[int]:
        """`all_token_ids[lo:hi]` without copying the rest of the context (0 <= lo <= hi)."""
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if lo >= n:
            return outputs[lo - n : hi - n]
        return prompt[lo:hi] + outputs[: max(hi - n, 0)]

    def token_at(self, i: int) -> int:
        """`all_token_ids[i]` (0 <= i < num_tokens) without building it."""
        prompt = self.prompt_token_ids
        return prompt[i] if i < len(prompt) else self.output_token_ids[i - len(prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not yet made (no output token yet): every prompt
        position is computed, none served from the prefix cache."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (unless ignore_eos, or min_tokens not yet reached).
        Made once: `sampling` and `eos_token_ids` never change."""
        extra = frozenset(self.sampling.stop_token_ids)
        return extra if self.sampling.ignore_eos else self.eos_token_ids | extra
