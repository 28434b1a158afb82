"""The `TokenDelta` a scheduler emits when a request gets a token."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.outputs import SampledToken, TokenDelta
from deepinfer.request import FinishReason, Request


def token_delta(
    request: Request, sampled: Sequence[SampledToken], reason: FinishReason | None
) -> TokenDelta:
    """The delta for the `sampled` tokens (one, or a step's verified run), already appended to
    `request`'s outputs."""
    return TokenDelta(
        request_id=request.request_id,
        token_ids=tuple(s.token_id for s in sampled),
        logprobs=tuple(sampled) if request.sampling.logprobs is not None else (),
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_output_tokens=len(request.output_token_ids),
    )
