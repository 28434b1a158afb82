"""`MatcherTable`: one runner's grammar matchers, one per constrained request.

A request's matcher is made on its first sampled step, moved with the request between runners
(`take`/`adopt`, like its random stream) and dropped when the request is released. It is
advanced only by the fill of a step that samples its request (`fill_rows`, see `mask_fill.py`):
first it catches up with the request's kept outputs (`ConstraintMatcher.sync`: the token
sampled by the step before is accepted there), then it writes the row. So a request preempted
by recompute, or re-prefilled on another runner, continues where its outputs left it: the
tokens already accepted are never accepted twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer.request import Request
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher


def end_token_ids(request: Request) -> frozenset[int]:
    """What a constrained row may take when its grammar ends: end-of-turn and stop tokens."""
    return request.eos_token_ids | frozenset(request.sampling.stop_token_ids)


@dataclass(frozen=True, eq=False)
class MaskRow:
    """One constrained row of a step's mask: where it goes and what its matcher needs. The
    output list is the request's own, read only while its step runs (nothing appends then)."""

    index: int
    """The request's first row; a speculative step's request has one more per draft."""
    matcher: ConstraintMatcher
    output_token_ids: Sequence[int]
    end_token_ids: frozenset[int]
    draft_token_ids: Sequence[int] = ()
    """The drafts the step verifies: rows `index + 1 ..` are the positions after each."""


SampledRequest = tuple[Request, Sequence[int]]
"""A request a step samples and the drafts it verifies (empty: one row)."""


def fill_rows(words: np.ndarray, rows: Sequence[MaskRow]) -> None:
    """Catch each row's matcher up with its outputs, then write its rows of `words` (packed
    int32 `[B, W]`, all ones beforehand; the rows not named stay unconstrained)."""
    for row in rows:
        row.matcher.sync(row.output_token_ids, row.end_token_ids)
        if row.draft_token_ids:
            end = row.index + 1 + len(row.draft_token_ids)
            row.matcher.fill_drafts(words[row.index : end], row.draft_token_ids, row.end_token_ids)
        else:
            row.matcher.fill(words[row.index], row.end_token_ids)


class MatcherTable:
    def __init__(self, compiler: ConstraintCompiler | None) -> None:
        self.compiler = compiler
        self._matchers: dict[str, ConstraintMatcher] = {}

    def mask_rows(self, sampled: Sequence[SampledRequest]) -> list[MaskRow]:
        """The constrained rows of a step's `sampled` requests (in order, each with its drafts:
        one row per position), their matchers made on first use; empty when none is
        constrained."""
        if self.compiler is None or all(r.sampling.structured is None for r, _ in sampled):
            return []
        rows: list[MaskRow] = []
        index = 0
        for request, drafts in sampled:
            matcher = self._matcher(request)
            if matcher is not None:
                ends = end_token_ids(request)
                rows.append(MaskRow(index, matcher, request.output_token_ids, ends, drafts))
            index += 1 + len(drafts)
        return rows

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
