"""Request transitions shared by both schedulers: arrival checks, preemption, finishing."""

from __future__ import annotations

from collections import deque
from collections.abc import Container

from deepinfer.cache.manager import KVCacheManager
from deepinfer.errors import ContextLengthError, InvalidRequestError, OverloadedError
from deepinfer.request import FinishReason, Request, RequestStatus


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


def preempt_request(kv: KVCacheManager, request: Request, waiting: deque[Request]) -> None:
    """Free the request's blocks (their content stays hittable) and put it at the front of the
    waiting queue to recompute; the caller removes it from its running queue."""
    kv.free(request)
    request.num_computed_tokens = 0
    request.status = RequestStatus.PREEMPTED
    request.num_preemptions += 1
    waiting.appendleft(request)


def finish_request(
    kv: KVCacheManager, request: Request, reason: FinishReason, requests: dict[str, Request]
) -> None:
    """Release everything the request holds; the caller removes it from its queue."""
    kv.free(request)
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    del requests[request.request_id]
