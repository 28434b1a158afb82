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


class PromptLogprob(msgspec.Struct, frozen=True):
    """A prompt token's log-probability given the tokens before it: `log_softmax` of the raw
    logits (no penalty, bias or temperature: the prompt was not sampled)."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens more likely than this one."""
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
    prompt_logprobs: dict[str, tuple[PromptLogprob, ...]] = msgspec.field(default_factory=dict)
    """For a request asking for prompt logprobs whose first token this step sampled: those of
    its prompt tokens after the first, in order (the prompt's every chunk, gathered)."""


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
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    """On the first token's delta of a request asking for them: its prompt tokens' logprobs
    after the first (`RunnerOutput.prompt_logprobs`); None on any other delta."""
    num_accepted_prediction_tokens: int = 0
    """Tokens of the request's prediction kept so far (`Request.num_accepted_prediction_tokens`)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
