"""Messages that leave the runner and the engine."""

from __future__ import annotations

import msgspec

from deepinfer.message import message
from deepinfer.request import FinishReason


class SampledToken(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float | None = None
    """Log-probability of the sampled token (only when logprobs were asked for)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The top-n (token id, logprob) pairs, most likely first."""


class RunnerOutput(msgspec.Struct, frozen=True):
    """What one forward step produced: one sampled token per chunk that had `sample=True`
    (from a worker's thread to the loop)."""

    step: int
    sampled: dict[str, SampledToken] = msgspec.field(default_factory=dict)
    elapsed_s: float = 0.0
    accepted: dict[str, tuple[SampledToken, ...]] = msgspec.field(default_factory=dict)
    """Speculative decoding: for a request that verified drafts, the tokens after `sampled`'s
    (the agreed drafts beyond the first, then the model's pick after them)."""
    drafted: dict[str, int] = msgspec.field(default_factory=dict)
    """Drafts the worker made per request that asked for some (`num_worker_drafts`): what it
    verified, maybe fewer than asked."""


@message
class TokenDelta:
    """New output of one request since the last delta (engine -> embedding API, token ids only)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
