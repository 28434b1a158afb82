"""Request transitions shared by both schedulers: arrival, admission, preemption, finishing.

`WaitingQueue` is the one admission core. Both schedulers admit in arrival order, each request
starting after its prefix-cache hit; they differ only in how many tokens an admission allocates
(the colocated scheduler: a chunk within the step's token budget; the disaggregated one: the
whole uncached prompt, keeping blocks in reserve for decoders), which `admit` takes as arguments.

A shared prefix in flight is computed once: a request whose next uncached block another
running request is computing (`KVCacheManager.computing_elsewhere`) is passed over, not
admitted: it keeps its place in the queue, does not hold up those behind it, and is admitted
once the blocks are registered, hitting them. Should the computing request be aborted or
preempted, its claims go with it and the waiter computes what is left itself (what was already
computed stays in the cache).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass

from deepinfer.cache.free_queue import require
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


@dataclass(frozen=True)
class PrefillCounts:
    """Prompt work since start: what was computed, and what waiting for blocks in flight saved."""

    num_computed_tokens: int = 0
    """Tokens computed by prefill chunks (prompts, and recomputation after preemption)."""
    num_inflight_saved_tokens: int = 0
    """Tokens that requests hit after waiting for another request to compute them."""
    num_inflight_waits: int = 0
    """Requests that waited for a shared prefix in flight."""


class WaitingQueue:
    """The waiting queue in arrival order and the table of live requests, shared by both
    schedulers, with their one admission rule."""

    def __init__(self, kv: KVCacheManager, max_request_tokens: int, max_waiting: int) -> None:
        self.kv = kv
        self.max_request_tokens = max_request_tokens
        self.max_waiting = max_waiting
        self.queue: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        """Every live request (waiting, running, or between lanes)."""
        self._waited_from: dict[str, int] = {}
        """Requests passed over for blocks in flight -> their prefix hit when first passed."""
        self.num_computed_tokens = 0
        self.num_saved_tokens = 0
        self.num_waits = 0

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, request: Request) -> None:
        """Queue a new request. Raises `InvalidRequestError` (empty prompt, duplicate id),
        `ContextLengthError` (cannot fit), `OverloadedError` (queue full)."""
        check_new_request(
            request, self.requests, self.max_request_tokens, len(self.queue), self.max_waiting
        )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.queue.append(request)

    def remove(self, request: Request) -> None:
        """Take a waiting request out of the queue (abort)."""
        self.queue = deque(r for r in self.queue if r is not request)
        self._waited_from.pop(request.request_id, None)

    def admit(
        self, max_count: int, token_budget: int | None = None, reserve_blocks: int = 0
    ) -> list[tuple[Request, int]]:
        """Admit up to `max_count` waiting requests in arrival order: each takes its prefix hit
        and blocks for its uncached prompt (`token_budget` None) or for a chunk of it within
        `token_budget` tokens for all admissions, leaving `reserve_blocks` free. The first that
        does not fit stops admission (FCFS); requests waiting for blocks in flight are passed
        over. Returns (request, tokens to compute now), now RUNNING."""
        admitted: list[tuple[Request, int]] = []
        for request in list(self.queue):
            if len(admitted) >= max_count or token_budget == 0:
                break
            hits, num_hit = self.kv.get_computed_blocks(request)
            if self.kv.computing_elsewhere(request, len(hits) * self.kv.block_size):
                self._pass_over(request, num_hit)
                continue
            num_new = request.num_tokens - num_hit
            if token_budget is not None:
                num_new = min(num_new, token_budget)
            if not self.kv.can_allocate(request, num_new, hits, reserve_blocks=reserve_blocks):
                break
            allocated = self.kv.allocate_slots(request, num_new, hits)
            require(allocated, "can_allocate promised room")
            self._start(request, num_hit)
            admitted.append((request, num_new))
            if token_budget is not None:
                token_budget -= num_new
        if admitted:
            started = {id(r) for r, _ in admitted}
            self.queue = deque(r for r in self.queue if id(r) not in started)
        return admitted

    def _pass_over(self, request: Request, num_hit: int) -> None:
        if request.request_id not in self._waited_from:
            self._waited_from[request.request_id] = num_hit
            self.num_waits += 1

    def _start(self, request: Request, num_hit: int) -> None:
        waited_from = self._waited_from.pop(request.request_id, None)
        if waited_from is not None:
            self.num_saved_tokens += max(num_hit - waited_from, 0)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.kv.claim_prompt_blocks(request)

    def computed(self, num_tokens: int) -> None:
        """Count prompt tokens a prefill chunk computed."""
        self.num_computed_tokens += num_tokens

    def preempt(self, kv: KVCacheManager, request: Request) -> None:
        """Free a running request's blocks in `kv` and requeue it at the front to recompute."""
        preempt_request(kv, request, self.queue)

    def finish(self, kv: KVCacheManager, request: Request, reason: FinishReason) -> None:
        """Release what the request holds in `kv` and forget it."""
        self._waited_from.pop(request.request_id, None)
        finish_request(kv, request, reason, self.requests)

    def counts(self) -> PrefillCounts:
        return PrefillCounts(self.num_computed_tokens, self.num_saved_tokens, self.num_waits)

    def check_integrity(self) -> None:
        for r in self.queue:
            require(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), "bad status")
            require(r.num_computed_tokens == 0, f"waiting {r.request_id} has computed tokens")
            require(self.kv.num_blocks_of(r.request_id) == 0, f"waiting {r.request_id} has blocks")
        require(set(self._waited_from) <= set(self.requests), "a finished request waits")
