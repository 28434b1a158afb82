"""Allowed-token bitmasks and logit_bias in the sampler: every row of a mixed batch (greedy,
sampled, filtered, logprobs, seeded) only ever takes an allowed token, its logprobs are those of
the masked distribution, a fully masked row still yields an id in the vocabulary, and biases
are added before everything else."""

from __future__ import annotations

import math

import numpy as np
import torch

from deepinfer.request import SamplingParams
from deepinfer.sampling import Sampler, SamplingRow, make_generator
from deepinfer.sampling.masking import unpack_bitmask

VOCAB = 300
WORDS = -(-VOCAB // 32)

PARAMS = (
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=2),
    SamplingParams(temperature=1.0, seed=7, logprobs=0),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5),
)


def _pack(allowed: list[set[int]]) -> torch.Tensor:
    words = np.zeros((len(allowed), WORDS), dtype=np.uint32)
    for i, ids in enumerate(allowed):
        for t in ids:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def _rows(seed_offset: int = 0) -> list[SamplingRow]:
    rows = []
    for i, p in enumerate(PARAMS):
        gen = make_generator(p.seed, 0, i + seed_offset) if p.seed is not None else None
        rows.append(SamplingRow(p, output_token_ids=(3, 4), generator=gen))
    return rows


def test_unpack_matches_the_bits() -> None:
    allowed = [{0, 31, 32, 299}, set(), set(range(VOCAB))]
    mask = unpack_bitmask(_pack(allowed), VOCAB)
    for i, ids in enumerate(allowed):
        assert set(torch.nonzero(mask[i]).squeeze(1).tolist()) == ids
    wider = unpack_bitmask(_pack([{1}]), VOCAB + 40)  # tokens past the mask: not allowed
    assert wider.shape == (1, VOCAB + 40) and wider[0].sum() == 1


def test_every_mode_takes_only_allowed_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=1)
    rng = np.random.default_rng(0)
    for step in range(40):
        logits = torch.randn(len(PARAMS), VOCAB, generator=g) * 4.0
        allowed = [set(rng.choice(VOCAB, size=int(rng.integers(1, 6)), replace=False).tolist())]
        allowed += [set(rng.choice(VOCAB, size=3, replace=False).tolist()) for _ in PARAMS[1:]]
        tokens = sampler.sample(logits, _rows(step), _pack(allowed))
        for i, tok in enumerate(tokens):
            assert tok.token_id in allowed[i]
            if PARAMS[i].logprobs is not None:
                assert tok.logprob is not None and math.isfinite(tok.logprob)
                top_ids = [t for t, lp in tok.top_logprobs if lp > -math.inf]
                assert set(top_ids) <= allowed[i]  # masked tokens have no probability
                masked = logits[i].clone()
                masked[[t for t in range(VOCAB) if t not in allowed[i]]] = -math.inf
                ref = torch.log_softmax(masked, 0)[tok.token_id].item()
                if PARAMS[i].repetition_penalty == 1.0:
                    assert abs(tok.logprob - ref) < 1e-4


def test_greedy_under_a_mask_is_the_masked_argmax() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    allowed = {5, 17, 250}
    (tok,) = Sampler().sample(logits, [SamplingRow(PARAMS[0])], _pack([allowed]))
    assert tok.token_id == max(allowed, key=lambda t: logits[0, t].item())


def test_seeded_rows_repeat_under_a_mask() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    allowed = _pack([set(range(0, VOCAB, 3))])
    runs = []
    for _ in range(2):
        gen = make_generator(11, 0, 0)
        row = SamplingRow(SamplingParams(temperature=1.0, seed=11), generator=gen)
        runs.append([Sampler().sample(logits, [row], allowed)[0].token_id for _ in range(5)])
    assert runs[0] == runs[1]


def test_fully_masked_row_stays_in_the_vocabulary() -> None:
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(5))
    allowed = [set() for _ in PARAMS]
    allowed[1] = {42}
    tokens = Sampler().sample(logits, _rows(), _pack(allowed))
    assert tokens[1].token_id == 42
    for tok in tokens:
        assert 0 <= tok.token_id < VOCAB
        assert tok.logprob is None or math.isfinite(tok.logprob)


def test_logit_bias_is_added_first() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 10] = 5.0
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logit_bias=((20, 100.0),))),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias=((10, -100.0), (30, 1.0)))),
        SamplingRow(SamplingParams(temperature=1.0, logit_bias=((99, 100.0), (VOCAB + 5, 1.0)))),
    ]
    tokens = Sampler().sample(logits, rows)
    assert [t.token_id for t in tokens] == [20, 30, 99]
    # a bias cannot bring back a masked token: the mask applies after it
    masked = Sampler().sample(logits[:1], rows[:1], _pack([{10, 11}]))
    assert masked[0].token_id == 10


def test_logit_bias_shifts_logprobs() -> None:
    logits = torch.zeros(1, VOCAB)
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=1, logit_bias=((7, 2.0),)))
    (tok,) = Sampler().sample(logits, [row])
    expected = 2.0 - math.log(math.exp(2.0) + VOCAB - 1)
    assert tok.token_id == 7 and abs(tok.logprob - expected) < 1e-5  # type: ignore[operator]
