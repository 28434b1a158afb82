"""Numeric guards: NaN, +-inf and fully suppressed rows never give an id outside the
vocabulary, nor a non-finite logprob for the chosen token, greedy or sampled; sound rows in the
same batch are untouched."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deepinfer.outputs import SampledToken
from deepinfer.request import SamplingParams
from deepinfer.sampling import Sampler, SamplingRow, make_generator
from deepinfer.sampling.sampler import repair_logits

VOCAB = 300
NAN, INF = float("nan"), float("inf")
ALL_IDS = frozenset(range(VOCAB + 5))  # ids past the vocabulary are ignored

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, logprobs=3),
    "sampled": SamplingParams(temperature=1.0, logprobs=3),
    "filtered": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=0),
    "penalized": SamplingParams(temperature=0.5, repetition_penalty=1.3, presence_penalty=0.4),
}


def _base(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 3.0


def _bad_rows() -> dict[str, tuple[torch.Tensor, frozenset[int]]]:
    """name -> (logits row, suppressed ids)."""
    base = _base()
    one_nan, one_inf, two_inf = base.clone(), base.clone(), base.clone()
    one_nan[int(base.argmax())] = NAN
    one_inf[7] = INF
    two_inf[[9, 4]] = INF
    mixed = base.clone()
    mixed[:100], mixed[100:200] = NAN, -INF
    return {
        "all_nan": (torch.full((VOCAB,), NAN), frozenset()),
        "one_nan": (one_nan, frozenset()),
        "one_inf": (one_inf, frozenset()),
        "two_inf": (two_inf, frozenset()),
        "all_neg_inf": (torch.full((VOCAB,), -INF), frozenset()),
        "nan_and_neg_inf": (mixed, frozenset()),
        "all_suppressed": (base.clone(), ALL_IDS),
        "all_suppressed_nan": (torch.full((VOCAB,), NAN), ALL_IDS),
        "huge": (base * 1e37, frozenset()),
    }


def _check(token: SampledToken, params: SamplingParams) -> None:
    assert 0 <= token.token_id < VOCAB
    if params.logprobs is not None:
        assert token.logprob is not None and math.isfinite(token.logprob)
        assert token.logprob <= 0.0
        assert all(0 <= t < VOCAB and not math.isnan(v) for t, v in token.top_logprobs)


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("name", list(_bad_rows()))
def test_bad_rows_give_in_range_ids_and_finite_logprobs(name: str, kind: str) -> None:
    row, suppress = _bad_rows()[name]
    params = PARAMS[kind]
    sound = _base(seed=3)
    logits = torch.stack([sound, row, sound])  # [3, V]
    for seed in range(3):
        rows = [
            SamplingRow(
                params,
                output_token_ids=[1, 2],
                prompt_token_ids=[3],
                generator=make_generator(seed, 0, i),
                suppress_token_ids=suppress if i == 1 else frozenset(),
            )
            for i in range(3)
        ]
        tokens = Sampler(seed=seed).sample(logits, rows)
        for token in tokens:
            _check(token, params)
        alone = Sampler(seed=seed).sample(
            sound.unsqueeze(0),
            [dataclasses.replace(rows[0], generator=make_generator(seed, 0, 0))],
        )
        assert tokens[0] == alone[0], "a sound row changed because of its neighbour"


def _sample(row: torch.Tensor, params: SamplingParams, **kw: object) -> list[int]:
    rows = [
        SamplingRow(params, generator=make_generator(s, 0, 0), **kw)  # type: ignore[arg-type]
        for s in range(40)
    ]
    tokens = Sampler().sample(row.unsqueeze(0).expand(len(rows), -1).contiguous(), rows)
    return [t.token_id for t in tokens]


def test_nan_is_never_chosen_while_another_token_can_be() -> None:
    row, _ = _bad_rows()["one_nan"]
    nan_id = int(_base().argmax())
    rest = row.clone()
    rest[nan_id] = -INF
    assert _sample(row, SamplingParams(temperature=0.0)) == [int(rest.argmax())] * 40
    assert nan_id not in _sample(row, SamplingParams(temperature=1.0))
    mixed, _ = _bad_rows()["nan_and_neg_inf"]
    assert all(t >= 200 for t in _sample(mixed, SamplingParams(temperature=1.0)))


def test_positive_infinity_wins() -> None:
    one, _ = _bad_rows()["one_inf"]
    two, _ = _bad_rows()["two_inf"]
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)):
        assert set(_sample(one, params)) == {7}
        assert set(_sample(two, params)) <= {4, 9}


def test_fully_suppressed_row_falls_back_to_its_raw_logits() -> None:
    base = _base()
    greedy = _sample(base, SamplingParams(temperature=0.0), suppress_token_ids=ALL_IDS)
    assert greedy == [int(base.argmax())] * 40
    top = set(base.topk(5).indices.tolist())
    sampled = _sample(base, SamplingParams(temperature=1.0, top_k=5), suppress_token_ids=ALL_IDS)
    assert set(sampled) <= top and len(set(sampled)) > 1, "still sampled, from the raw logits"


def test_repair_logits_semantics() -> None:
    raw = torch.tensor([[1.0, 2.0, NAN], [NAN, NAN, NAN], [0.0, INF, -INF]])
    processed = torch.tensor([[-INF, -INF, -INF], [NAN, NAN, NAN], [0.0, INF, NAN]])
    out = repair_logits(processed, raw)
    largest = torch.finfo(torch.float32).max
    expected = torch.tensor([[1.0, 2.0, -INF], [0.0, 0.0, 0.0], [0.0, largest, -INF]])
    assert torch.equal(out, expected)


def test_sound_batches_skip_the_repair(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("repair on sound rows")

    monkeypatch.setattr(Sampler, "_repair", refuse)
    logits = torch.stack([_base(s) for s in range(6)])
    rows = [SamplingRow(p) for p in list(PARAMS.values()) + list(PARAMS.values())[:2]]
    for token, row in zip(Sampler().sample(logits, rows), rows, strict=True):
        _check(token, row.params)
