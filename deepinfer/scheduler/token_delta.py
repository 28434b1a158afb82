"""A sampling step's tokens appended to a request, and the `TokenDelta` a scheduler emits."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.outputs import PromptLogprob, RunnerOutput, SampledToken, TokenDelta
from deepinfer.request import FinishReason, Request
from deepinfer.scheduler.stop import check_finished


def take_tokens(
    request: Request, out: RunnerOutput, max_model_len: int
) -> tuple[list[SampledToken], FinishReason | None]:
    """Append a sampling step's tokens for `request` (its pick, then any verified run) up to
    the first that finishes it; the tokens appended and the finish reason."""
    rid = request.request_id
    first = out.sampled[rid]
    request.output_token_ids.append(first.token_id)
    taken = [first]
    reason = check_finished(request, max_model_len)
    if reason is not None or not out.accepted:
        return taken, reason
    for sampled in out.accepted.get(rid, ()):
        request.output_token_ids.append(sampled.token_id)
        taken.append(sampled)
        reason = check_finished(request, max_model_len)
        if reason is not None:
            return taken, reason
    return taken, None


def token_delta(
    request: Request,
    sampled: Sequence[SampledToken],
    reason: FinishReason | None,
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None,
) -> TokenDelta:
    """The delta for the `sampled` tokens (one, or a step's verified run), already appended to
    `request`'s outputs; with the prompt's logprobs on a first token's delta that has them."""
    return TokenDelta(  # positional: one per request per step, keywords cost more
        request.request_id,
        (sampled[0].token_id,) if len(sampled) == 1 else tuple([s.token_id for s in sampled]),
        tuple(sampled) if request.sampling.logprobs is not None else (),
        reason,
        len(request.prompt_token_ids),
        max(request.num_cached_tokens, 0),
        len(request.output_token_ids),
        prompt_logprobs,
        request.num_accepted_prediction_tokens,
    )
