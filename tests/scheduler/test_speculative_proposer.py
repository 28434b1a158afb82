"""The n-gram proposer's lookup against a plain-Python search, draft verification, and which
requests may speculate at all (the gate: `test_draft_gate.py`)."""

from __future__ import annotations

import random

import pytest

from deepinfer.config import Config, SpeculativeConfig, WorkersConfig
from deepinfer.errors import ConfigError
from deepinfer.outputs import SampledToken
from deepinfer.runner.speculative import verify_drafts
from deepinfer.scheduler.draft_gate import Draft
from deepinfer.scheduler.output import ScheduledChunk
from deepinfer.scheduler.speculative import NgramProposer, ngram_lookup
from tests.scheduler.sched_fakes import make_request


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for i in range(end - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tuple(tokens[i + n : i + n + k])
    return ()


@pytest.mark.parametrize("seed", range(4))
def test_lookup_matches_a_plain_search(seed: int) -> None:
    """Over small and huge vocabularies (token ids whose bytes repeat inside other ids: the
    byte search must keep to whole tokens)."""
    rng = random.Random(seed)
    for _ in range(500):
        vocab = rng.choice([2, 3, 7, 300, 70_000, 1 << 40])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 50))]
        for min_n, max_n, k in [(2, 4, 5), (1, 3, 2), (3, 3, 1)]:
            got, n = ngram_lookup(tokens, min_n, max_n, k)
            assert got == _reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
            assert (min_n <= n <= max_n) if got else n == 0
            assert not got or tokens[len(tokens) - n :] in _windows(tokens[:-1], n)


def _windows(tokens: list[int], n: int) -> list[list[int]]:
    return [tokens[i : i + n] for i in range(len(tokens) - n + 1)]


def test_proposer_continues_the_latest_match() -> None:
    request = make_request("r", [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 3, 5, 6, 7], temperature=0.0)
    # the latest "5 6 7" is followed by 9; the match is 3 of at most 4 tokens
    assert NgramProposer().propose(request, 3) == Draft((9, 3, 5), (0.75,))
    assert NgramProposer().propose(request, 0) == Draft()
    assert NgramProposer().propose(make_request("s", [1, 2, 3, 4]), 5) == Draft()


def test_proposer_keeps_up_with_a_growing_request() -> None:
    """Its packed copy of the tokens grows with the request (and starts over when the request
    is shorter, as after preemption): every proposal is a fresh lookup's."""
    rng = random.Random(5)
    proposer = NgramProposer(window=16)
    request = make_request("r", [rng.randrange(4) for _ in range(6)], temperature=0.0)
    for step in range(60):
        want, _ = ngram_lookup(request.all_token_ids[-16:], 2, 4, 3)
        assert proposer.propose(request, 3).token_ids == want, step
        request.output_token_ids.append(rng.randrange(4))
        if step == 30:
            del request.output_token_ids[:]
    proposer.forget("r")
    want, _ = ngram_lookup(request.all_token_ids[-16:], 2, 4, 3)
    assert proposer.propose(request, 3).token_ids == want


def _chunk(drafts: tuple[int, ...]) -> ScheduledChunk:
    request = make_request("r", [1, 2, 3])
    return ScheduledChunk(request, 2, 1 + len(drafts), (1,), True, drafts)


@pytest.mark.parametrize(
    ("drafts", "picks", "first", "after"),
    [
        ((), [4], 4, None),
        ((4, 5, 6), [4, 5, 6, 7], 4, (5, 6, 7)),  # all agreed: the pick after the last, too
        ((4, 9, 6), [4, 5, 6, 7], 4, (5,)),  # the second draft is wrong: the model's 5 instead
        ((9, 5), [4, 5, 6], 4, ()),  # the first is wrong: only the model's pick
    ],
)
def test_verification_keeps_the_agreed_run(
    drafts: tuple[int, ...], picks: list[int], first: int, after: tuple[int, ...] | None
) -> None:
    sampled, accepted = verify_drafts([_chunk(drafts)], [SampledToken(t) for t in picks])
    assert sampled["r"].token_id == first
    got = accepted.get("r")
    assert (None if got is None else tuple(s.token_id for s in got)) == after


def test_config_refuses_what_is_not_built_only() -> None:
    with pytest.raises(ConfigError, match="speculative must be one of"):
        Config(speculative=SpeculativeConfig(speculative="medusa"))
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        Config(speculative=SpeculativeConfig(speculative="ngram", num_draft_tokens=0))
    Config(  # both worker modes draft
        speculative=SpeculativeConfig(speculative="ngram"), workers=WorkersConfig(colocated=True)
    )
