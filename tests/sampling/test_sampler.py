"""The Sampler end to end: greedy, seeds, logprobs, mixed batches, generators."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from deepinfer.kernels.native.greedy import greedy_ids
from deepinfer.outputs import SampledToken
from deepinfer.request import SamplingParams
from deepinfer.sampling import GREEDY_TEMPERATURE, Sampler, SamplingRow, make_generator
from deepinfer.sampling import sampler as sampler_module
from deepinfer.sampling.generators import inverse_cdf_pick, request_seed
from tests.sampling.sampling_reference import final_probs, processed_logits

VOCAB = 300
GREEDY = SamplingParams(temperature=0.0)


def _logits(num_rows: int, seed: int = 0, vocab_size: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * 3.0


def test_greedy_batch_is_argmax() -> None:
    logits = _logits(64)
    tokens = Sampler().sample(logits, [SamplingRow(GREEDY) for _ in range(64)])
    assert [t.token_id for t in tokens] == [int(np.argmax(row)) for row in logits.numpy()]
    assert all(t.logprob is None and t.top_logprobs == () for t in tokens)


def test_plain_greedy_rows_are_known_once() -> None:
    """A row is plain greedy (its pick the argmax of its raw logits) only with nothing to apply
    and nothing to report."""
    assert SamplingRow(GREEDY).plain_greedy
    assert SamplingRow(GREEDY, [1, 2], [3]).plain_greedy  # tokens seen matter to penalties only
    not_plain = [
        SamplingRow(SamplingParams(temperature=0.5)),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0)),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias=((1, 1.0),))),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.2)),
        SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.1)),
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.1)),
        SamplingRow(GREEDY, suppress_token_ids=frozenset({2})),
    ]
    assert not any(row.plain_greedy for row in not_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_greedy_rows_pick_what_the_full_pipeline_picks(dtype: torch.dtype) -> None:
    """The argmax-only path against the full one (a zero bias takes a row through it): ties
    to the first, half precision, and rows the guards repair (NaN, +inf, all -inf)."""
    logits = _logits(12, seed=21).to(dtype)
    logits[1, 5] = logits[1, 9] = 100.0  # a tie
    logits[2, 7] = float("nan")
    logits[3, 4] = float("inf")
    logits[4] = float("-inf")
    plain = [SamplingRow(GREEDY) for _ in range(12)]
    full = [SamplingRow(SamplingParams(temperature=0.0, logit_bias=((0, 0.0),)))] * 12
    assert all(row.plain_greedy for row in plain) and not full[0].plain_greedy
    got = Sampler().sample(logits, plain)
    assert got == Sampler().sample(logits, full)
    assert got[1].token_id == 5 and got[3].token_id == 4
    clean = logits[5:]  # no repair: the lean path alone
    assert Sampler().sample(clean, plain[5:]) == Sampler().sample(clean, full[5:])


class _CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def test_batch_work_is_grouped_not_looped(monkeypatch: pytest.MonkeyPatch) -> None:
    greedy_calls: list[int] = []

    def counted(rows: torch.Tensor) -> torch.Tensor:
        greedy_calls.append(rows.shape[0])
        return greedy_ids(rows)

    monkeypatch.setattr(sampler_module, "greedy_ids", counted)
    logits = _logits(64, seed=9)
    greedy = [SamplingRow(GREEDY) for _ in range(32)]
    sampled = [SamplingRow(SamplingParams(top_k=5, top_p=0.9, min_p=0.01)) for _ in range(32)]
    penalized = [
        SamplingRow(SamplingParams(frequency_penalty=1.0), [1, 2, 3], [4]) for _ in range(64)
    ]
    with _CallCounter() as counter:
        Sampler().sample(logits, greedy + sampled)
        Sampler().sample(logits, penalized)
    assert greedy_calls == [32]  # the greedy rows at once (the penalized rows are sampled)
    assert counter.calls["rand"] == 2  # one draw per call, shared by its rows
    assert counter.calls["searchsorted"] == 4  # the sampled rows' picks and caps, per call
    assert counter.calls["sort"] == counter.calls["topk"] == 1
    assert counter.calls["index_put_"] == 1


def test_tiny_temperature_is_greedy() -> None:
    logits = _logits(8, seed=1)
    params = SamplingParams(temperature=GREEDY_TEMPERATURE / 10)
    tokens = Sampler().sample(logits, [SamplingRow(params) for _ in range(8)])
    assert [t.token_id for t in tokens] == logits.argmax(dim=1).tolist()


def test_input_logits_are_not_modified_and_half_precision_is_accepted() -> None:
    logits = _logits(4, seed=2).to(torch.bfloat16)
    before = logits.clone()
    row = SamplingRow(
        SamplingParams(repetition_penalty=1.5), [1, 2], [3], suppress_token_ids=frozenset({4})
    )
    Sampler().sample(logits, [row] * 4)
    assert torch.equal(logits, before)


def test_suppressed_tokens_are_never_sampled() -> None:
    logits = torch.zeros(2000, 6)
    logits[:, 2] = 5.0  # the favourite, suppressed
    rows = [
        SamplingRow(SamplingParams(), suppress_token_ids=frozenset({2, 5})) for _ in range(2000)
    ]
    tokens = {t.token_id for t in Sampler().sample(logits, rows)}
    assert tokens == {0, 1, 3, 4}
    greedy = Sampler().sample(logits[:1], [SamplingRow(GREEDY, suppress_token_ids=frozenset({2}))])
    assert greedy[0].token_id == 0


def _generate(seed: int | None, steps: int = 60, request_index: int = 0) -> list[int]:
    """A toy model: next logits depend on the last token, with penalties on the history."""
    table = _logits(VOCAB, seed=42)  # [V, V]
    params = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=seed)
    generator = make_generator(seed, default_seed=0, request_index=request_index)
    sampler = Sampler(seed=123)
    out: list[int] = []
    last = 0
    for _ in range(steps):
        row = SamplingRow(params, out, [0], generator)
        last = sampler.sample(table[last : last + 1], [row])[0].token_id
        out.append(last)
    return out


def test_same_seed_same_sequence_different_seeds_differ() -> None:
    first = _generate(seed=7)
    assert first == _generate(seed=7)
    assert first != _generate(seed=8)
    assert len(set(first)) > 5


def test_unseeded_requests_derive_distinct_reproducible_streams() -> None:
    assert _generate(None, request_index=3) == _generate(None, request_index=3)
    assert _generate(None, request_index=3) != _generate(None, request_index=4)
    assert request_seed(None, 0, 3) != request_seed(None, 1, 3)
    assert request_seed(-1, 0, 0) == 2**64 - 1
    assert request_seed(5, 0, 0) == request_seed(5, 9, 9) == 5


def test_shared_generator_is_seeded_from_config() -> None:
    logits = _logits(32, seed=3)
    rows = [SamplingRow(SamplingParams()) for _ in range(32)]
    a = [t.token_id for t in Sampler(seed=1).sample(logits, rows)]
    assert a == [t.token_id for t in Sampler(seed=1).sample(logits, rows)]
    assert a != [t.token_id for t in Sampler(seed=2).sample(logits, rows)]


def _check_logprobs(token: SampledToken, logits: np.ndarray, row: SamplingRow) -> None:
    processed = processed_logits(logits, row)
    finite = np.isfinite(processed)
    reference = np.full_like(processed, -np.inf)
    shifted = processed[finite] - processed[finite].max()
    reference[finite] = shifted - np.log(np.exp(shifted).sum())
    assert token.logprob is not None
    assert np.isclose(token.logprob, reference[token.token_id], atol=1e-4)
    n = row.params.logprobs or 0
    assert [t for t, _ in token.top_logprobs] == np.argsort(-reference, kind="stable")[:n].tolist()
    np.testing.assert_allclose(
        [v for _, v in token.top_logprobs], np.sort(reference)[::-1][:n], atol=1e-4
    )


def test_logprobs_are_log_softmax_of_penalized_logits() -> None:
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5)),
        SamplingRow(
            SamplingParams(temperature=0.5, top_k=3, logprobs=20), generator=make_generator(1, 0, 0)
        ),
        SamplingRow(
            SamplingParams(logprobs=0, repetition_penalty=1.4, presence_penalty=0.5),
            [1, 2, 2],
            [7, 8],
        ),
        SamplingRow(
            SamplingParams(temperature=0.0, logprobs=3), suppress_token_ids=frozenset({5, 6})
        ),
        SamplingRow(SamplingParams()),
    ]
    logits = _logits(len(rows), seed=4)
    tokens = Sampler().sample(logits, rows)
    for i in range(4):
        _check_logprobs(tokens[i], logits[i].numpy(), rows[i])
    assert tokens[2].top_logprobs == ()
    assert tokens[4].logprob is None and tokens[4].top_logprobs == ()


def _mixed_rows() -> list[SamplingRow]:
    def gen(seed: int) -> torch.Generator:
        return make_generator(seed, default_seed=0, request_index=0)

    return [
        SamplingRow(GREEDY),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.3), [3, 4], [5, 6]),
        SamplingRow(SamplingParams(temperature=0.8, top_k=5), generator=gen(1)),
        SamplingRow(
            SamplingParams(top_p=0.9, frequency_penalty=0.5, logprobs=3), [1, 1, 9], [2], gen(2)
        ),
        SamplingRow(SamplingParams(min_p=0.1), generator=gen(3), suppress_token_ids=frozenset({0})),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [7], [7]),
        SamplingRow(
            SamplingParams(temperature=1.2, presence_penalty=1.0), [8, 8], generator=gen(4)
        ),
        SamplingRow(SamplingParams()),  # shared generator: not compared
    ]


def test_mixed_batch_equals_each_row_alone() -> None:
    logits = _logits(8, seed=5)
    batch = Sampler(seed=9).sample(logits, _mixed_rows())
    for i, row in enumerate(_mixed_rows()[:-1]):
        alone = Sampler(seed=10).sample(logits[i : i + 1], [row])[0]
        assert alone.token_id == batch[i].token_id
        alone_lp, batch_lp = alone.logprob, batch[i].logprob
        if alone_lp is None or batch_lp is None:
            assert alone_lp is None and batch_lp is None
        else:
            assert np.isclose(alone_lp, batch_lp, atol=1e-6)
        assert [t for t, _ in alone.top_logprobs] == [t for t, _ in batch[i].top_logprobs]


def test_mixed_batch_picks_agree_with_reference() -> None:
    logits = _logits(8, seed=6)
    rows = _mixed_rows()
    tokens = Sampler().sample(logits, rows)
    for token, row, row_logits in zip(tokens, rows, logits.numpy(), strict=True):
        processed = processed_logits(row_logits, row)
        if row.greedy:
            assert token.token_id == int(np.argmax(processed))
        else:
            assert final_probs(processed, row.params)[token.token_id] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_and_is_reproducible() -> None:
    device = torch.device("cuda")
    logits = _logits(8, seed=7)
    rows = _mixed_rows()
    cpu = Sampler().sample(logits, rows)

    def cuda_rows() -> list[SamplingRow]:
        return [
            dataclasses.replace(
                r, generator=None if r.generator is None else make_generator(i, 0, 0, device)
            )
            for i, r in enumerate(_mixed_rows())
        ]

    first = Sampler(device=device).sample(logits.to(device), cuda_rows())
    second = Sampler(device=device).sample(logits.to(device), cuda_rows())
    assert [t.token_id for t in first] == [t.token_id for t in second]
    for a, b, row in zip(cpu, first, rows, strict=True):
        if row.greedy:
            assert a.token_id == b.token_id
        if a.token_id == b.token_id and a.logprob is not None and b.logprob is not None:
            assert np.isclose(a.logprob, b.logprob, atol=1e-4)


def test_inverse_cdf_pick_follows_the_cumulative_mass_and_skips_empty_tokens() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    draws = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf_pick(probs, draws).tolist() == [1, 1, 3, 3, 3]
    unnormalized = torch.tensor([[2.0, 0.0, 6.0, 0.0]])  # the total need not be 1
    assert inverse_cdf_pick(unnormalized, torch.tensor([0.24], dtype=torch.float64)).item() == 0
    assert inverse_cdf_pick(unnormalized, torch.tensor([0.26], dtype=torch.float64)).item() == 2


def test_each_sampled_row_draws_one_number_from_its_generator() -> None:
    generator = make_generator(5, 0, 0)
    row = SamplingRow(SamplingParams(temperature=0.9), generator=generator)
    Sampler().sample(_logits(1, seed=4), [row])
    expected = make_generator(5, 0, 0)
    torch.rand(1, generator=expected, dtype=torch.float64)
    assert torch.equal(generator.get_state(), expected.get_state())


def test_logits_are_not_copied_when_nothing_adjusts_them() -> None:
    logits = _logits(3, seed=8)
    plain = [SamplingRow(SamplingParams(temperature=0.7)) for _ in range(3)]
    assert Sampler().process_logits(logits, plain) is logits
    penalized = [*plain[:2], SamplingRow(SamplingParams(presence_penalty=0.5), [1])]
    processed = Sampler().process_logits(logits, penalized)
    assert processed is not logits and torch.equal(processed[:2], logits[:2])


def test_transposed_logits_sample_like_contiguous_ones() -> None:
    """The model hands over [B, V] logits stored as [V, B] (its last matmul, untransposed)."""
    logits = _logits(6, seed=10)
    transposed = logits.t().contiguous().t()
    rows = _mixed_rows()[:6]
    a = [t.token_id for t in Sampler(seed=3).sample(logits, rows)]
    b = [t.token_id for t in Sampler(seed=3).sample(transposed, _mixed_rows()[:6])]
    assert a == b
