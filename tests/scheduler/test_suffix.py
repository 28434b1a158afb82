"""Suffix decoding's proposer against a plain-Python reference that counts occurrences in lists
(a suffix tree's counts: each draft token the most frequent continuation, each estimate the
share of the matched occurrences that continue that way), the tenants' stores (shared within a
cache salt, never across, bounded), and `auto`'s choice between suffix decoding and n-grams."""

from __future__ import annotations

import random

import pytest

from deepinfer.config import Config, SpeculativeConfig
from deepinfer.request import Request
from deepinfer.scheduler.speculative import (
    ChoiceProposer,
    NgramProposer,
    build_proposer,
)
from deepinfer.scheduler.suffix import (
    MATCH_THRESHOLDS,
    MAX_MATCH,
    MIN_MATCH,
    MIN_TOKEN_PROB,
    SPEC_FACTOR,
    SUFFIX_DRAFT_TOKENS,
    SuffixDraft,
    SuffixProposer,
    TenantOutputs,
)
from tests.scheduler.sched_fakes import make_request


def _count(tokens: list[int], s: list[int], last_start: int) -> int:
    """Occurrences of `s` in `tokens` starting at or before `last_start`, overlaps included."""
    k = len(s)
    return sum(tokens[i : i + k] == s for i in range(0, last_start + 1))


def _reference(tokens: list[int], max_tokens: int) -> SuffixDraft:
    """The best draft by counting: for a match length m, the tail's last m tokens s occur
    (ending before the tail does) c times; the draft's j-th token is the continuation t of
    s + draft that occurs most often (ties: the one whose latest such occurrence is latest), its
    estimate count(s + draft + t) / c."""
    n = len(tokens)
    matches = []
    for c in range(MIN_MATCH, n):  # continuation start c <= n - 1
        m = 0
        while m < min(MAX_MATCH, c) and tokens[c - 1 - m] == tokens[n - 1 - m]:
            m += 1
        if m >= MIN_MATCH:
            matches.append(m)
    if not matches:
        return SuffixDraft()
    longest = max(matches)
    best = SuffixDraft()
    for m in sorted({longest, *(t for t in MATCH_THRESHOLDS if t < longest)}, reverse=True):
        s = tokens[n - m :]
        total = _count(tokens, s, n - 1 - m)
        draft: list[int] = []
        probs: list[float] = []
        for _ in range(min(max_tokens, int(SPEC_FACTOR * m))):
            prefix = s + draft
            k = len(prefix)
            latest: dict[int, int] = {}
            counts: dict[int, int] = {}
            for i in range(0, n - 1 - m + 1):
                if tokens[i : i + k] == prefix and i + k < n:
                    t = tokens[i + k]
                    counts[t] = counts.get(t, 0) + 1
                    latest[t] = i
            if not counts:
                break
            t = max(counts, key=lambda x: (counts[x], latest[x]))
            prob = counts[t] / total
            if prob < MIN_TOKEN_PROB:
                break
            draft.append(t)
            probs.append(prob)
        found = SuffixDraft(tuple(draft), tuple(probs), m)
        if found.score > best.score:
            best = found
    return best


@pytest.mark.parametrize("seed", range(3))
def test_drafts_match_the_counting_reference(seed: int) -> None:
    """Random token runs over small alphabets (many repeats) and ids whose bytes repeat inside
    other ids (the byte search must keep to whole tokens)."""
    rng = random.Random(seed)
    checked = 0
    for i in range(300):
        vocab = rng.choice([2, 3, 5, 257, 1 << 40])
        base = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        tokens = (base * rng.randint(1, 4))[: rng.randint(1, 40)]
        tokens += [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        want = _reference(tokens, SUFFIX_DRAFT_TOKENS)
        got = SuffixProposer().suffix_draft(make_request(f"r{i}", tokens), SUFFIX_DRAFT_TOKENS)
        assert got.token_ids == want.token_ids, tokens
        assert got.probs == pytest.approx(want.probs)
        checked += bool(want.token_ids)
    assert checked > 100  # most runs repeat enough to draft


def test_the_majority_continuation_wins_over_the_latest() -> None:
    """Prompt lookup copies the latest occurrence; suffix decoding the most frequent."""
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 9, 1, 2]
    request = make_request("r", tokens)
    assert NgramProposer().propose(request, 1).token_ids == (9,)
    draft = SuffixProposer().propose(request, 4)
    assert draft.token_ids[0] == 3
    assert draft.signals == (pytest.approx(2 / MAX_MATCH), pytest.approx(3 / 4))


def test_outputs_follow_the_request_step_by_step_and_after_preemption() -> None:
    proposer = SuffixProposer()
    request = make_request("r", [5, 6, 7, 8, 5, 6])
    assert proposer.propose(request, 2).token_ids == (7, 8)
    request.output_token_ids.extend([7, 8, 5])
    assert proposer.propose(request, 1).token_ids == (6,)
    request.output_token_ids.clear()  # recomputed: the proposer starts over from the tokens
    request.output_token_ids.append(9)
    assert proposer.propose(request, 3).token_ids == ()


def _finish(proposer: SuffixProposer, rid: str, salt: str | None, output: list[int]) -> None:
    request = make_request(rid, [100, 101], salt=salt)
    proposer.propose(request, 1)
    request.output_token_ids.extend(output)
    proposer.propose(request, 1)
    proposer.forget(rid)


def _asking(rid: str, salt: str | None, tail: list[int]) -> Request:
    return make_request(rid, [300, *tail], salt=salt)


def test_a_tenants_outputs_draft_for_its_next_requests_only() -> None:
    proposer = SuffixProposer()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    _finish(proposer, "a", "team-a", answer)
    _finish(proposer, "b", "team-a", answer)
    asked = proposer.propose(_asking("c", "team-a", answer[:3]), 5)
    assert asked.token_ids == tuple(answer[3:8])
    assert proposer.propose(_asking("d", "team-b", answer[:3]), 5).token_ids == ()
    assert proposer.propose(_asking("e", None, answer[:3]), 5).token_ids == ()


def test_the_tenants_stores_are_bounded() -> None:
    store = TenantOutputs(max_tokens=100, max_tenants=3)
    rng = random.Random(0)
    last: list[int] = []
    for _ in range(200):
        last = [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        store.add("t", last)
        assert store.num_tokens("t") <= 101
    kept = store.get("t")
    assert kept is not None
    tail = memoryview(kept).cast("q").tolist()
    assert tail[-len(last) - 2 :] == [-1, *last, -1]  # the latest output whole, separated
    assert tail[0] == -1
    store.add("t", list(range(500)))  # longer than the store: its last tokens, alone
    assert memoryview(store.get("t") or b"").cast("q").tolist() == [-1, *range(401, 500), -1]
    for tenant in ("a", "b", "c"):
        store.add(tenant, [1, 2])
    assert store.get("t") is None  # the least recently used tenant left
    assert all(store.num_tokens(t) == 4 for t in ("a", "b", "c"))


class _Fixed:
    """A proposer that always drafts the same tokens and records what it was told."""

    num_signals = 1
    max_draft_tokens: int | None = None

    def __init__(self, name: str, tokens: tuple[int, ...]) -> None:
        self.name, self.tokens = name, tokens
        self.observed: list[tuple[int, int]] = []
        self.forgotten: list[str] = []

    def propose(self, request: Request, max_tokens: int) -> object:
        from deepinfer.scheduler.draft_gate import Draft

        return Draft(self.tokens[:max_tokens], (1.0,)) if self.tokens else Draft()

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.observed.append((num_drafts, num_accepted))

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def test_auto_follows_the_proposer_whose_drafts_the_output_agrees_with() -> None:
    first, second = _Fixed("first", (1, 2, 3)), _Fixed("second", (7, 8, 9))
    choice = ChoiceProposer([first, second], 3)  # type: ignore[list-item]
    request = make_request("r", [1, 2, 3])
    draft = choice.propose(request, 3)
    assert draft.token_ids == (1, 2, 3) and draft.signals == (1.0,)  # ties: the first
    assert choice.chosen("r") == "first"
    choice.observe("r", 3, 0)  # the first's draft fails: its proposer is told
    assert first.observed == [(3, 0)] and second.observed == []
    request.output_token_ids.append(7)  # the model went the second's way
    assert choice.propose(request, 3).token_ids == (7, 8, 9)
    assert choice.chosen("r") == "second"
    request.output_token_ids.extend([7, 8, 9, 5])  # its draft kept whole, the first's not
    assert choice.propose(request, 3).token_ids == (7, 8, 9)
    other = make_request("o", [1])  # another request starts from the even prior
    assert choice.propose(other, 2).token_ids == (1, 2)
    first.tokens = ()  # the preferred one has nothing: the next one drafts
    assert choice.propose(other, 2).token_ids == (7, 8)
    choice.forget("r")
    assert first.forgotten == ["r"] and second.forgotten == ["r"]


def test_auto_ranks_by_tokens_kept_per_look_the_unchosen_draft_judged_too() -> None:
    """Both proposers are judged on the tokens the request produced, whichever draft the step
    verified; near the best, the longer draft is taken (a look cannot tell a short draft kept
    whole from a longer one agreeing as far), and a clear winner is taken though shorter."""
    short, long = _Fixed("short", (0, 1, 2)), _Fixed("long", (0, 1, *range(20, 33)))
    choice = ChoiceProposer([short, long], 15)  # type: ignore[list-item]
    request = make_request("r", [1, 2, 3])
    assert choice.propose(request, 15).token_ids == long.tokens  # even prior: the longer
    choice.observe("r", 15, 2)
    assert long.observed == [(15, 2)] and short.observed == []  # the verified one's proposer
    request.output_token_ids.extend([0, 1, 2, 3])  # the short draft would have kept 3, not 2
    assert choice.propose(request, 15).token_ids == (0, 1, 2)
    assert choice.chosen("r") == "short"
    request.output_token_ids.extend([0, 1, 20, 21, 22])  # the long one would have kept 5
    assert choice.propose(request, 15).token_ids == long.tokens
    assert choice.chosen("r") == "long"


def test_auto_pads_signals_for_the_gate() -> None:
    choice = build_proposer(SpeculativeConfig(speculative="auto"))
    assert isinstance(choice, ChoiceProposer) and choice.num_signals == 2
    assert choice.max_draft_tokens == SUFFIX_DRAFT_TOKENS
    request = make_request("r", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    draft = choice.propose(request, 3)
    assert draft.token_ids and len(draft.signals) == 2
    assert isinstance(build_proposer(SpeculativeConfig(speculative="suffix")), SuffixProposer)
    Config(speculative=SpeculativeConfig(speculative="suffix"))
