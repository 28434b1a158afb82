"""`MatcherTable`: one runner's grammar matchers, one per constrained request.

A request's matcher is made on its first sampled step, advanced once per sampled token right
after sampling (on the worker thread), moved with the request between runners (`take`/`adopt`,
like its random stream) and dropped when the request is released. Before each fill it catches
up with the request's kept outputs (`ConstraintMatcher.sync`), so a request preempted by
recompute, or re-prefilled on another runner, continues where its outputs left it: the tokens
already accepted are never accepted twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.outputs import SampledToken
from deepinfer.request import Request
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher


def end_token_ids(request: Request) -> frozenset[int]:
    """What a constrained row may take when its grammar ends: end-of-turn and stop tokens."""
    return request.eos_token_ids | frozenset(request.sampling.stop_token_ids)


class MatcherTable:
    def __init__(self, compiler: ConstraintCompiler | None) -> None:
        self.compiler = compiler
        self._matchers: dict[str, ConstraintMatcher] = {}

    def bitmask(self, requests: Sequence[Request], vocab_size: int) -> torch.Tensor | None:
        """`[B, ceil(V / 32)]` int32 allowed tokens of `requests` (rows in order; all ones for
        unconstrained rows), or None when none is constrained."""
        if self.compiler is None or all(r.sampling.structured is None for r in requests):
            return None
        words = np.full((len(requests), -(-vocab_size // 32)), -1, dtype=np.int32)
        for i, request in enumerate(requests):
            matcher = self._matcher(request)
            if matcher is not None:
                ends = end_token_ids(request)
                matcher.sync(request.output_token_ids, ends)
                matcher.fill(words[i], ends)
        return torch.from_numpy(words)

    def advance(self, requests: Sequence[Request], tokens: Sequence[SampledToken]) -> None:
        """Accept each constrained request's sampled token (once, right after sampling)."""
        for request, token in zip(requests, tokens, strict=True):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                matcher.accept(token.token_id, end_token_ids(request))

    def _matcher(self, request: Request) -> ConstraintMatcher | None:
        spec = request.sampling.structured
        if spec is None or self.compiler is None:
            return None
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            matcher = self.compiler.matcher(spec)
            self._matchers[request.request_id] = matcher
        return matcher

    def get(self, request_id: str) -> ConstraintMatcher | None:
        return self._matchers.get(request_id)

    def take(self, request_id: str) -> ConstraintMatcher | None:
        return self._matchers.pop(request_id, None)

    def adopt(self, request_id: str, matcher: ConstraintMatcher | None) -> None:
        if matcher is not None:
            self._matchers[request_id] = matcher

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def __len__(self) -> int:
        return len(self._matchers)
