"""Checks shared by both schedulers when a request arrives."""

from __future__ import annotations

from collections.abc import Container

from deepinfer.errors import ContextLengthError, InvalidRequestError, OverloadedError
from deepinfer.request import Request


def check_new_request(
    request: Request,
    known_ids: Container[str],
    max_request_tokens: int,
    num_waiting: int,
    max_waiting: int,
) -> None:
    """Raise `InvalidRequestError` (empty prompt, duplicate id), `ContextLengthError` (prompt
    plus max_tokens cannot fit) or `OverloadedError` (queue full); else return."""
    if not request.prompt_token_ids:
        raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
    if request.request_id in known_ids:
        raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
    max_tokens = request.sampling.max_tokens
    if request.num_prompt_tokens + max_tokens > max_request_tokens:
        raise ContextLengthError(request.num_prompt_tokens, max_tokens, max_request_tokens)
    if num_waiting >= max_waiting:
        raise OverloadedError(f"{num_waiting} requests are already waiting; retry later")
