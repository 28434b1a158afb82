"""Draft proposers for speculative decoding, behind one protocol.

The decode lane asks a proposer for up to `num_draft_tokens` tokens that may follow a request's
tokens; the step then computes the request's last token and the drafts in one forward pass
(causal rows of one chunk), and the runner keeps the longest run of drafts the model's own greedy
picks agree with, plus the model's pick after them (`runner/speculative.py`). Rejected drafts'
KV sits past `num_computed_tokens`: never registered in the prefix cache (which registers only
fully computed blocks), overwritten by the request's next step.

Drafts are asked for wherever verifying them cannot change the output (`can_speculate`): any
sampling (greedy, or sampled with the request's own random numbers, penalties, `min_tokens`;
`runner/speculative.py` says why the picks stay the plain ones) and stop strings (the stream
reads a verified run token by token and ends at the one completing a stop, the tokens after it
neither output nor counted: `engine/stream.py`), but no grammar (its matcher would have to walk
the drafts).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.config import SpeculativeConfig
from deepinfer.request import Request
from deepinfer.scheduler.cost_model import ChunkShape, StepCostModel


@dataclass(frozen=True)
class SpeculativeCounts:
    """Speculative decoding since start: drafts verified, how many the model agreed with, and in
    how many request-steps (the mean accepted run is `num_accepted / num_verified`)."""

    proposer: str = "none"
    num_drafted: int = 0
    num_accepted: int = 0
    num_verified: int = 0


class Proposer(Protocol):
    """Proposes draft tokens to follow a request's tokens (cheap, on the event loop)."""

    name: str

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        """At most `max_tokens` tokens (maybe none) likely to follow `request.all_token_ids`."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the proposer kept for it."""
        ...


def can_speculate(request: Request) -> bool:
    """Whether verifying drafts leaves this request's tokens exactly as plain decoding picks
    them (see the module docstring)."""
    return request.sampling.structured is None


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from `max_n` down to `min_n`) and propose the tokens that followed it."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, window: int = 4096) -> None:
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._seen: dict[str, array[int]] = {}
        """Each request's tokens as packed int64s, extended by the new ones each step."""

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        if max_tokens <= 0:
            return ()
        tokens = request.all_token_ids
        packed = self._seen.setdefault(request.request_id, array("q"))
        if len(packed) > len(tokens):  # recomputed after preemption: start over
            del packed[:]
        packed.extend(tokens[len(packed) :])
        start = max(0, len(tokens) - self.window)
        return ngram_lookup(tokens, self.min_n, self.max_n, max_tokens, packed, start)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


def ngram_lookup(
    tokens: Sequence[int],
    min_n: int,
    max_n: int,
    max_tokens: int,
    packed: array[int] | None = None,
    start: int = 0,
) -> tuple[int, ...]:
    """The tokens after the latest earlier match of the longest suffix n-gram (min_n <= n <=
    max_n), at most `max_tokens`; () when no suffix of those lengths occurred at or after
    `start`. The search runs over the tokens packed as int64 bytes (`packed`, when the caller
    keeps them), in C (`bytes.rfind`), kept to whole tokens."""
    end = len(tokens)
    data = memoryview(packed if packed is not None else array("q", tokens)).cast("B")
    width = 8
    for n in range(min(max_n, end - 1 - start), min_n - 1, -1):
        needle = bytes(data[(end - n) * width : end * width])
        limit = (end - 1) * width  # so that a match starts before the suffix itself
        while (at := _rfind(data, needle, start * width, limit)) >= 0:
            if at % width == 0:
                i = at // width
                return tuple(tokens[i + n : i + n + max_tokens])
            limit = at - 1 + len(needle)
    return ()


def _rfind(data: memoryview, needle: bytes, lo: int, hi: int) -> int:
    """bytes.rfind over data[lo:hi] (without copying the bytes before `lo`... nor after)."""
    found = data[lo:hi].tobytes().rfind(needle) if hi > lo else -1
    return found + lo if found >= 0 else -1


@dataclass
class _Rate:
    accepted: float = 0.0
    trials: float = 0.0


class DraftGate:
    """How many of each request's drafts a decode step verifies.

    Each request's drafts are accepted position by position with probability p (the j-th draft
    with p^j: it needs the ones before it), where p is the request's own observed rate, pulled
    toward the proposer's rate over all requests (which starts at `prior_rate`) by
    `prior_strength` pseudo-trials. Positions are added best first while the tokens a step is
    expected to produce per second of predicted step time grows: a position of acceptance q
    and marginal cost dc is worth it when q / dc exceeds the step's current tokens / cost.
    Step costs come from the decode lane's own `StepCostModel` (a draft is one more query row
    of its request's chunk). `enabled=False` verifies every draft (the baseline).
    """

    def __init__(
        self,
        cost_model: StepCostModel,
        enabled: bool = True,
        prior_rate: float = 0.5,
        prior_strength: float = 4.0,
    ) -> None:
        self.cost_model = cost_model
        self.enabled = enabled
        self.prior_rate, self.prior_strength = prior_rate, prior_strength
        self._global = _Rate()
        self._rates: dict[str, _Rate] = {}

    def rate(self, request_id: str) -> float:
        """The estimated chance that a request's next draft is accepted (given the previous)."""
        g, k = self._global, self.prior_strength
        base = (g.accepted + k * self.prior_rate) / (g.trials + k)
        own = self._rates.get(request_id, _Rate())
        return (own.accepted + k * base) / (own.trials + k)

    def worth_proposing(self, requests: Sequence[Request]) -> list[bool]:
        """Whether a first draft of each request could pay in a step of all of them (if not,
        the proposer is not even asked)."""
        if not self.enabled:
            return [True] * len(requests)
        per_second = len(requests) / self._plain_step_s(requests)
        return [self.rate(r.request_id) / self._draft_s(r, 0) > per_second for r in requests]

    def _plain_step_s(self, requests: Sequence[Request]) -> float:
        """Predicted seconds of a step of `requests` without drafts."""
        chunks = [ChunkShape(1, r.num_computed_tokens) for r in requests]
        return max(self.cost_model.predict(chunks), 1e-9)

    def _draft_s(self, request: Request, j: int) -> float:
        """Predicted seconds that a request's (j + 1)-th draft adds to its chunk."""
        cost, ctx = self.cost_model, request.num_computed_tokens
        return max(cost.chunk_cost_s(j + 2, ctx) - cost.chunk_cost_s(j + 1, ctx), 1e-12)

    def choose(self, candidates: Sequence[tuple[Request, int]]) -> list[int]:
        """For each (request, drafts available), how many to verify. Every request of the step
        is listed (those without drafts with 0): the step's cost depends on all of them."""
        if not self.enabled:
            return [n for _, n in candidates]
        tokens = float(len(candidates))
        seconds = self._plain_step_s([r for r, _ in candidates])
        chosen = [0] * len(candidates)
        rates = [self.rate(r.request_id) for r, _ in candidates]

        def option(i: int) -> tuple[float, float, float, int]:
            """(-gain, expected tokens, seconds) of request i's next position."""
            extra = self._draft_s(candidates[i][0], chosen[i])
            q = rates[i] ** (chosen[i] + 1)
            return (-q / extra, q, extra, i)

        heap = [option(i) for i, (_, n) in enumerate(candidates) if n > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, q, extra, i = heapq.heappop(heap)
            if -neg_gain <= tokens / seconds:
                break  # the best position left would lower tokens per second
            tokens, seconds = tokens + q, seconds + extra
            chosen[i] += 1
            if chosen[i] < candidates[i][1]:
                heapq.heappush(heap, option(i))
        return chosen

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """A step verified `verified` drafts of a request and the model agreed with the first
        `accepted`: the positions tried are the accepted ones and the first rejected one."""
        if verified <= 0:
            return
        trials = accepted + (1 if accepted < verified else 0)
        for rate in (self._global, self._rates.setdefault(request_id, _Rate())):
            rate.accepted += accepted
            rate.trials += trials

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)


def build_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The configured proposer; None when speculative decoding is off."""
    if config.speculative == "ngram":
        return NgramProposer()
    return None
