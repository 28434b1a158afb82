"""Checks a request passes before it is queued: it fits the context, the queue has room, its
logit biases name real tokens, and its grammar compiles (off the event loop)."""

from __future__ import annotations

import asyncio

from deepinfer.errors import ContextLengthError, InvalidRequestError, OverloadedError
from deepinfer.request import SamplingParams
from deepinfer.sampling.constraints import ConstraintCompiler


def check_admissible(
    ids: list[int], params: SamplingParams, max_model_len: int, num_waiting: int, max_waiting: int
) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(ids) + params.max_tokens > max_model_len:
        raise ContextLengthError(len(ids), params.max_tokens, max_model_len)
    if num_waiting >= max_waiting:
        raise OverloadedError("too many requests are waiting; retry shortly", retry_after_s=1)


async def check_sampling_inputs(
    params: SamplingParams, vocab_size: int, constraints: ConstraintCompiler
) -> None:
    """logit_bias ids inside the vocabulary; the structured-output grammar compiled (and
    cached for the runners) off the loop, or refused with what the library rejected."""
    for token_id, _ in params.logit_bias:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})",
                param="logit_bias",
            )
    if params.structured is not None:
        await asyncio.to_thread(constraints.compile, params.structured)
