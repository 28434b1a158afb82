"""Draft proposers for speculative decoding, behind one protocol.

The decode lane asks a proposer for up to `num_draft_tokens` tokens that may follow a request's
tokens; the step then computes the request's last token and the drafts in one forward pass
(causal rows of one chunk), and the runner keeps the longest run of drafts the model's own picks
agree with, plus the model's pick after them (`runner/speculative.py`). Rejected drafts'
KV sits past `num_computed_tokens`: never registered in the prefix cache (which registers only
fully computed blocks), overwritten by the request's next step.

Drafts are asked for whatever a request asks of sampling, since verifying them cannot change
its output: greedy, or sampled with the request's own random numbers, penalties, `min_tokens`
(`runner/speculative.py` says why the picks stay the plain ones), stop strings (the stream reads
a verified run token by token and ends at the one completing a stop, the tokens after it neither
output nor counted: `engine/stream.py`) and grammars (the step's mask has a row per position,
its matcher walked along the drafts: `sampling/constraints.py`, `ConstraintMatcher.fill_drafts`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.config import SpeculativeConfig
from deepinfer.request import Request
from deepinfer.scheduler.draft_gate import CalibrationBucket, Draft
from deepinfer.scheduler.suffix import SuffixProposer


@dataclass(frozen=True)
class SpeculativeCounts:
    """Speculative decoding since start: drafts verified, how many the model agreed with, and in
    how many request-steps (the mean accepted run is `num_accepted / num_verified`)."""

    proposer: str = "none"
    num_drafted: int = 0
    num_accepted: int = 0
    num_verified: int = 0
    calibration: tuple[CalibrationBucket, ...] = ()
    """The gate's predicted against observed acceptance, by bucket of prediction."""

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted per request-step that verified some."""
        return self.num_accepted / self.num_verified if self.num_verified else 0.0


class Proposer(Protocol):
    """Proposes draft tokens to follow a request's tokens (cheap, on the event loop)."""

    name: str
    num_signals: int
    """How many confidence signals each of its drafts carries (`Draft.signals`)."""
    max_draft_tokens: int | None
    """Most tokens one of its drafts holds where it sizes its own drafts (suffix decoding's
    estimates decide); None: `--num-draft-tokens`."""

    def propose(self, request: Request, max_tokens: int) -> Draft:
        """At most `max_tokens` tokens (maybe none) likely to follow `request.all_token_ids`."""
        ...

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` of the request's latest drafts and kept the first
        `num_accepted`."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the proposer kept for it."""
        ...


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from `max_n` down to `min_n`) and propose the tokens that followed it."""

    name = "ngram"
    num_signals = 1
    """The matched n-gram's length, as n / max_n."""
    max_draft_tokens: int | None = None

    def __init__(self, min_n: int = 2, max_n: int = 4, window: int = 4096) -> None:
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._seen: dict[str, array[int]] = {}
        """Each request's tokens as packed int64s, extended by the new ones each step."""

    def propose(self, request: Request, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft()
        packed = self._seen.setdefault(request.request_id, array("q"))
        if len(packed) > request.num_tokens:  # recomputed after preemption: start over
            del packed[:]
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        if len(packed) < len(prompt):
            packed.extend(prompt[len(packed) :])
        packed.extend(outputs[len(packed) - len(prompt) :])  # the new tokens only, no copy
        start = max(0, len(packed) - self.window)
        found, n = ngram_lookup(packed, self.min_n, self.max_n, max_tokens, packed, start)
        return Draft(found, (n / self.max_n,)) if found else Draft()

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


def ngram_lookup(
    tokens: Sequence[int],
    min_n: int,
    max_n: int,
    max_tokens: int,
    packed: array[int] | None = None,
    start: int = 0,
) -> tuple[tuple[int, ...], int]:
    """The tokens after the latest earlier match of the longest suffix n-gram (min_n <= n <=
    max_n), at most `max_tokens`, and that n; ((), 0) when no suffix of those lengths occurred
    at or after `start`. The search runs over the tokens packed as int64 bytes (`packed`, when the caller
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
                return tuple(tokens[i + n : i + n + max_tokens]), n
            limit = at - 1 + len(needle)
    return (), 0


def _rfind(data: memoryview, needle: bytes, lo: int, hi: int) -> int:
    """bytes.rfind over data[lo:hi] (without copying the bytes before `lo`... nor after)."""
    found = data[lo:hi].tobytes().rfind(needle) if hi > lo else -1
    return found + lo if found >= 0 else -1


class WorkerProposer:
    """Drafts made on the worker at the start of the step that verifies them
    (`runner/worker_draft.py`: the model's first layers, or a draft model;
    `runner/worker_mtp.py`: the checkpoint's MTP layer); here only the room for them is
    asked."""

    num_signals = 0
    max_draft_tokens: int | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def propose(self, request: Request, max_tokens: int) -> Draft:
        return Draft(num_worker_tokens=max(max_tokens, 0))

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


CHOICE_RECENCY = 0.8
"""A request's earlier looks count this much less at each new one (`ChoiceProposer`)."""
CHOICE_NEAR = 0.9
"""Proposers whose tokens kept per look are within this share of the best one's count as
near-best (`ChoiceProposer`), and the longest draft among them is taken: a look judges a draft
only on the tokens produced after it, at most what the verified draft held plus one, so a short
draft whose tokens were all kept ties with a longer one that agrees as far and might have kept
more. Taking the longer one lets it show that."""


@dataclass
class _Look:
    """The drafts each proposer made for a request at one step, scored at the next."""

    at: int
    """The request's output length when they were made."""
    drafts: list[tuple[int, ...]]
    """Each proposer's tokens (empty: none, or drafted on the worker)."""


class ChoiceProposer:
    """`auto`: for each request, the proposer whose drafts would have kept the most tokens
    lately, the next one where that one has nothing; the gate then cuts the draft, to nothing
    where it would not pay. Signals: the chosen proposer's, padded with 0.5 (the gate's neutral
    value) to the most any of them has.

    Every proposer that drafts tokens here is asked at each look, and its draft is scored when
    the next one comes: how many of the tokens the request produced since agree with it (a
    draft's kept tokens, whichever proposer's draft the step verified: the one not chosen is
    judged on the same tokens, so a request that settles on one proposer still sees when the
    other would do better). Tokens kept per look, recency-weighted from an even prior of one
    token in two looks, rank them (a proposer that drafts 15 tokens and sees 8 kept makes a step
    worth more than one that drafts 5 and sees 4 kept; each verified row's cost is the gate's
    to weigh), and among those near the best (`CHOICE_NEAR`) the longest draft is verified
    (equal lengths: the better ranked, then the first listed). A proposer that drafts on the
    worker (no tokens here) is scored by its verifications' accepted tokens instead, when
    chosen."""

    name = "auto"

    def __init__(self, proposers: Sequence[Proposer], num_draft_tokens: int) -> None:
        self.proposers = tuple(proposers)
        self.num_signals = max(p.num_signals for p in self.proposers)
        self._limits = [p.max_draft_tokens or num_draft_tokens for p in self.proposers]
        self.max_draft_tokens: int | None = max(self._limits)
        self._scores: dict[str, list[list[float]]] = {}
        """Each request's [kept tokens, looks] by proposer."""
        self._looks: dict[str, _Look] = {}
        """Each request's latest drafts, to score at its next look."""
        self._last: dict[str, int] = {}
        """The proposer of each request's latest draft."""

    def propose(self, request: Request, max_tokens: int) -> Draft:
        rid = request.request_id
        scores = self._scores.setdefault(rid, [[1.0, 2.0] for _ in self.proposers])
        outputs = request.output_token_ids
        look = self._looks.pop(rid, None)
        if look is not None and len(outputs) > look.at:
            produced = outputs[look.at :]
            for score, drafted in zip(scores, look.drafts, strict=True):
                if drafted:
                    _add(score, _agreeing(drafted, produced))
        drafts = [
            p.propose(request, min(max_tokens, limit))
            for p, limit in zip(self.proposers, self._limits, strict=True)
        ]
        self._looks[rid] = _Look(len(outputs), [d.token_ids for d in drafts])
        rated = [(score[0] / score[1], i) for i, score in enumerate(scores) if drafts[i].size]
        if not rated:
            self._last.pop(rid, None)
            return Draft()
        best = max(rate for rate, _ in rated)
        near = [(drafts[i].size, rate, -i) for rate, i in rated if rate >= best * CHOICE_NEAR]
        i = -max(near)[2]  # the longest near-best draft; then the better ranked, the first listed
        self._last[rid] = i
        draft = drafts[i]
        pad = (0.5,) * (self.num_signals - len(draft.signals))
        return Draft(draft.token_ids, draft.signals + pad, draft.num_worker_tokens)

    def chosen(self, request_id: str) -> str | None:
        """The proposer of the request's latest draft."""
        i = self._last.get(request_id)
        return self.proposers[i].name if i is not None else None

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        i = self._last.get(request_id)
        if i is None:
            return
        self.proposers[i].observe(request_id, num_drafts, num_accepted)
        look = self._looks.get(request_id)
        if look is not None and not look.drafts[i]:  # drafted on the worker: no tokens to score
            _add(self._scores[request_id][i], num_accepted)

    def forget(self, request_id: str) -> None:
        self._scores.pop(request_id, None)
        self._looks.pop(request_id, None)
        self._last.pop(request_id, None)
        for proposer in self.proposers:
            proposer.forget(request_id)


def _add(score: list[float], kept: float) -> None:
    score[0] = score[0] * CHOICE_RECENCY + kept
    score[1] = score[1] * CHOICE_RECENCY + 1.0


def _agreeing(drafted: Sequence[int], produced: Sequence[int]) -> int:
    """How many of a draft's first tokens the tokens produced after it agree with."""
    n = 0
    for d, t in zip(drafted, produced, strict=False):
        if d != t:
            break
        n += 1
    return n


def build_proposer(config: SpeculativeConfig, mtp: bool = False) -> Proposer | None:
    """The configured proposer; None when speculative decoding is off. `auto` chooses among
    suffix decoding, n-gram and, where the runner has the model's MTP layer (`mtp`), it."""
    if config.speculative == "ngram":
        return NgramProposer()
    if config.speculative == "suffix":
        return SuffixProposer()
    if config.speculative == "auto":
        choices: list[Proposer] = [SuffixProposer(), NgramProposer()]
        if mtp:
            choices.append(WorkerProposer("mtp"))
        return ChoiceProposer(choices, config.num_draft_tokens)
    if config.speculative in ("layers", "draft-model", "mtp"):
        return WorkerProposer(config.speculative)
    return None
