"""Suppression and penalties against the per-row reference in sampling_reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.request import SamplingParams
from deepinfer.sampling import Sampler, SamplingRow
from deepinfer.sampling.penalties import token_counts
from tests.sampling.sampling_reference import processed_logits

VOCAB = 50


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=g) * 4.0


def _rows() -> list[SamplingRow]:
    rng = np.random.default_rng(1)

    def ids(n: int) -> list[int]:
        return rng.integers(0, VOCAB, size=n).tolist()

    return [
        SamplingRow(SamplingParams(), ids(5), ids(9)),
        SamplingRow(SamplingParams(repetition_penalty=1.3), ids(7), ids(12)),
        SamplingRow(SamplingParams(repetition_penalty=0.7), ids(3), ids(4)),
        SamplingRow(SamplingParams(presence_penalty=0.8), ids(20), ids(10)),
        SamplingRow(SamplingParams(frequency_penalty=-1.1), ids(30), ids(3)),
        SamplingRow(
            SamplingParams(repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=0.9),
            ids(25),
            ids(15),
            suppress_token_ids=frozenset({0, 3, 7, VOCAB + 5}),
        ),
        SamplingRow(SamplingParams(), [], [], suppress_token_ids=frozenset({1, 2})),
        SamplingRow(SamplingParams(frequency_penalty=2.0), [], ids(6)),
    ]


def test_processed_logits_match_reference() -> None:
    rows = _rows()
    logits = _logits(len(rows))
    processed = Sampler().process_logits(logits, rows)
    for i, row in enumerate(rows):
        expected = processed_logits(logits[i].numpy(), row)
        np.testing.assert_allclose(processed[i].numpy(), expected, rtol=1e-6, atol=1e-5)


def test_each_row_alone_equals_the_batch() -> None:
    rows = _rows()
    logits = _logits(len(rows), seed=3)
    sampler = Sampler()
    batch = sampler.process_logits(logits, rows)
    for i, row in enumerate(rows):
        alone = sampler.process_logits(logits[i : i + 1], [row])
        assert torch.equal(alone[0], batch[i])


def test_suppressed_tokens_stay_minus_infinity_through_penalties() -> None:
    row = SamplingRow(
        SamplingParams(repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=-2.0),
        output_token_ids=[4, 4, 4],
        prompt_token_ids=[4],
        suppress_token_ids=frozenset({4}),
    )
    processed = Sampler().process_logits(torch.full((1, VOCAB), 10.0), [row])
    assert processed[0, 4].item() == float("-inf")
    assert torch.isfinite(processed[0, torch.arange(VOCAB) != 4]).all()


def test_greedy_pick_follows_penalized_logits() -> None:
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, **kw), out, prompt)  # type: ignore[arg-type]
        for kw, out, prompt in [
            ({"repetition_penalty": 2.0}, [5, 6], [7]),
            ({"presence_penalty": 2.0}, [1, 2, 3], []),
            ({"frequency_penalty": 1.5}, [9, 9, 9, 9], [9]),
        ]
    ]
    logits = _logits(len(rows), seed=5) / 4.0
    # Make the penalized tokens the raw favourites so the penalty must change the pick.
    logits[0, [5, 6, 7]] = torch.tensor([4.0, 3.9, 3.8])
    logits[1, [1, 2, 3]] = torch.tensor([4.0, 3.9, 3.8])
    logits[2, 9] = 4.0
    tokens = Sampler().sample(logits, rows)
    for i, row in enumerate(rows):
        expected = int(np.argmax(processed_logits(logits[i].numpy(), row)))
        assert tokens[i].token_id == expected
        assert tokens[i].token_id != int(logits[i].argmax())


@pytest.mark.parametrize("lists", [[[1, 1, 2], [], [3]], [[], []], [[0] * 5]])
def test_token_counts(lists: list[list[int]]) -> None:
    counts = token_counts(lists, VOCAB, torch.device("cpu"))
    expected = np.zeros((len(lists), VOCAB))
    for i, ids in enumerate(lists):
        for t in ids:
            expected[i, t] += 1
    np.testing.assert_array_equal(counts.numpy(), expected)
