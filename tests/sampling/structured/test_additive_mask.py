"""The additive form of a mask (`masking.additive_mask`, made while the forward pass runs on
CPU) samples exactly as the packed bitmask it comes from: same tokens, same logprobs, in every
sampling mode, with logit_bias, and with a row that allows nothing."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.request import SamplingParams
from deepinfer.sampling import Sampler, SamplingRow, make_generator
from deepinfer.sampling.masking import additive_mask, unpack_bitmask

VOCAB = 300
PARAMS = (
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0, seed=3, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=4),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, logit_bias=((7, 5.0), (9, -2.0))),
    SamplingParams(temperature=0.0, logit_bias=((11, 100.0),)),
)


def _rows() -> list[SamplingRow]:
    return [
        SamplingRow(p, output_token_ids=(3, 4), generator=make_generator(p.seed, 0, i))
        if p.seed is not None
        else SamplingRow(p, output_token_ids=(3, 4))
        for i, p in enumerate(PARAMS)
    ]


def test_additive_mask_is_the_unpacked_bitmask() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31 - 1, size=(3, 10), dtype=np.int32)
    for vocab in (300, 320, 350):  # narrower than, equal to and wider than the words
        mask = additive_mask(words, vocab)
        allowed = unpack_bitmask(torch.from_numpy(words), vocab).numpy()
        assert mask.shape == (3, vocab) and mask.dtype == np.float32
        assert ((mask == 0) == allowed).all() and (np.isneginf(mask) == ~allowed).all()
        buffer = np.full((5, 32 * max(10, -(-vocab // 32))), 7, dtype=np.uint32)  # reused
        for rows in (3, 2):  # a step of fewer rows after a larger one
            again = additive_mask(words[:rows], vocab, out=buffer)
            assert np.shares_memory(again, buffer) and again.shape == (rows, vocab)
            assert np.array_equal(again.view(np.uint32), mask[:rows].view(np.uint32))


def test_both_forms_sample_alike() -> None:
    rng = np.random.default_rng(1)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        words = rng.integers(-(2**31), 2**31 - 1, size=(len(PARAMS), 10), dtype=np.int32)
        words[-1] = 0  # nothing allowed: the guards decide, alike
        logits = torch.randn(len(PARAMS), VOCAB, generator=g) * 4.0
        packed = Sampler(seed=1).sample(logits, _rows(), torch.from_numpy(words))
        added = Sampler(seed=1).sample(
            logits, _rows(), torch.from_numpy(additive_mask(words, VOCAB))
        )
        assert packed == added
