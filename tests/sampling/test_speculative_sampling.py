"""Speculative verification of sampled requests, on a model whose next-token distribution is
known exactly: a Markov chain over 6 tokens (the logits row of a position is a table row chosen
by the position's input token).

- Each seeded request gives the same tokens with drafts as without, step for step, whatever
  the drafts (good, bad, or mixed), with temperature, top-k, penalties and `min_tokens`.
- The tokens follow the target distribution: a chi-square test of every transition's counts
  against the table's softmax, over thousands of tokens made with drafts; and the same test
  rejects a verifier that lets one rejected draft in five through (its power).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Sequence

import pytest
import torch
from scipy import stats

from deepinfer.model.arch import ModelArch
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.outputs import SampledToken
from deepinfer.request import Request, SamplingParams
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput, StepKind

VOCAB = 6
ARCH = ModelArch(
    architecture="llama", num_layers=1, hidden_size=8, intermediate_size=8, num_heads=1,
    num_kv_heads=1, head_dim=8, vocab_size=VOCAB, rope_theta=1e4, rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip


class MarkovLM:
    """Logits of a position: `table[input token]` (no KV, no attention: enough for the runner)."""

    arch = ARCH

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, VOCAB, generator=g) * 1.2

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return self.table[batch.input_ids[batch.logits_indices]].clone()


Drafter = Callable[[Request], tuple[int, ...]]


def _run(
    runner: ModelRunner,
    params: Sequence[SamplingParams],
    drafter: Drafter | None,
    steps: int,
    plain_flag: bool = False,
) -> list[list[int]]:
    """Each request's outputs after a prefill step and `steps` decode steps (all requests in
    each step), with the drafts `drafter` proposes (None: plain decoding); with `plain_flag`,
    steps without drafts say so (`ScheduleOutput.plain_decodes`)."""
    requests = [Request(f"r{i}", [i % VOCAB, 0], p) for i, p in enumerate(params)]
    blocks = tuple(range(8))
    for step in range(steps + 1):
        chunks = []
        for r in requests:
            start = 0 if step == 0 else r.num_tokens - 1
            drafts = drafter(r) if drafter is not None and step > 0 else ()
            chunks.append(
                ScheduledChunk(r, start, r.num_tokens - start + len(drafts), blocks, True, drafts)
            )
        plain = plain_flag and step > 0 and drafter is None
        so = ScheduleOutput(step, tuple(chunks), kind=StepKind.DECODE, plain_decodes=plain)
        out = runner.execute(so)
        for r in requests:
            new = [out.sampled[r.request_id], *out.accepted.get(r.request_id, ())]
            r.output_token_ids.extend(t.token_id for t in new)
    return [r.output_token_ids for r in requests]


def _runner() -> ModelRunner:
    return ModelRunner(MarkovLM(), block_size=64, device=torch.device("cpu"), seed=7)  # type: ignore[arg-type]


def _likely(model: MarkovLM, length: int) -> Drafter:
    """Drafts that follow the chain's most likely path (mostly accepted at low temperature)."""

    def drafts(r: Request) -> tuple[int, ...]:
        out, t = [], r.all_token_ids[-1]
        for _ in range(length):
            t = int(model.table[t].argmax())
            out.append(t)
        return tuple(out)

    return drafts


def _mixed(r: Request) -> tuple[int, ...]:
    """Drafts of every quality: a length and tokens that vary with the request and the step."""
    n = r.num_tokens
    return tuple((n * 7 + j * (1 + n % 3)) % VOCAB for j in range(n % 5))


PARAMS = [
    SamplingParams(max_tokens=64, temperature=1.0, seed=1),
    SamplingParams(max_tokens=64, temperature=0.5, top_k=3, seed=2),
    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=3),
    SamplingParams(max_tokens=64, temperature=1.2, presence_penalty=0.7, min_tokens=9, seed=4),
    SamplingParams(max_tokens=64, temperature=0.0, frequency_penalty=0.4),
    SamplingParams(max_tokens=64, temperature=0.7, seed=5, logprobs=2),
]


@pytest.mark.parametrize("which", ["likely", "mixed"])
def test_seeded_requests_keep_their_plain_tokens(which: str) -> None:
    """Same seed, same tokens, with and without drafts: every pick is the plain step's, and the
    numbers drawn for rejected positions are given back."""
    drafter = _likely(MarkovLM(), 4) if which == "likely" else _mixed
    params = [dataclasses.replace(p, seed=(p.seed or 0) + s) for s in range(4) for p in PARAMS]
    plain = _run(_runner(), params, None, steps=24)
    drafted = _run(_runner(), params, drafter, steps=24)
    for want, got in zip(plain, drafted, strict=True):
        assert got[: len(want)] == want
    assert sum(len(g) for g in drafted) > sum(len(w) for w in plain)  # drafts were accepted


def test_plain_decode_steps_match_the_general_path() -> None:
    """The runner's lean path for steps of plain decodes (rows made once per request, the
    sampler's argmax-only path for plain greedy rows) picks what the general path picks, for
    every kind of request, from the first decode step on (rows under `min_tokens` included)."""
    greedy = [
        SamplingParams(max_tokens=64, temperature=0.0),
        SamplingParams(max_tokens=64, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=64, temperature=0.0, min_tokens=5),
        SamplingParams(max_tokens=64, temperature=0.0, logit_bias=((3, 2.5),)),
    ]
    params = [dataclasses.replace(p, seed=(p.seed or 0) + s) for s in range(3) for p in PARAMS]
    params += greedy * 3
    general = _run(_runner(), params, None, steps=20)
    lean = _run(_runner(), params, None, steps=20, plain_flag=True)
    assert lean == general
    assert len({tuple(o) for o in lean}) > len(params) // 3  # the requests differ


def _p_values(model: MarkovLM, outputs: list[list[int]]) -> list[float]:
    """Each state's chi-square p-value: its transitions' counts against softmax(table[prev])."""
    counts = torch.zeros(VOCAB, VOCAB)
    for out in outputs:
        for prev, nxt in itertools.pairwise(out):
            counts[prev, nxt] += 1
    probs = model.table.softmax(dim=1)
    p_values = []
    for prev in range(VOCAB):
        row = counts[prev]
        assert row.sum() > 200
        expected = probs[prev] * row.sum()
        p_values.append(float(stats.chisquare(row.numpy(), expected.numpy())[1]))
    return p_values


def _sampled_with_drafts(model: MarkovLM) -> list[list[int]]:
    """2,000 unseeded requests (the shared generator: not the plain draws) at temperature 1,
    drafts on every step."""
    params = [SamplingParams(max_tokens=64, temperature=1.0)] * 2000
    runner = ModelRunner(model, block_size=64, device=torch.device("cpu"), seed=11)  # type: ignore[arg-type]
    return _run(runner, params, _mixed, steps=6)


@pytest.mark.slow
def test_tokens_follow_the_target_distribution() -> None:
    """Each transition's counts against softmax(table[prev])."""
    model = MarkovLM()
    outputs = _sampled_with_drafts(model)
    p_values = _p_values(model, outputs)
    assert min(p_values) > 1e-4, p_values
    drafted_runs = sum(len(o) for o in outputs) - 7 * len(outputs)
    assert drafted_runs > 1000  # many tokens came from accepted drafts


@pytest.mark.slow
def test_the_test_fails_a_lenient_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The power check: a verifier that lets a rejected draft through one time in five (the
    draft kept in place of the model's pick) skews the distribution toward the drafts, and the
    same test, on as many tokens, rejects it."""
    import deepinfer.runner.model_runner as model_runner

    honest = model_runner.verify_drafts
    rng = random.Random(0)

    def lenient(chunks: Sequence[ScheduledChunk], picks: Sequence[SampledToken]) -> tuple:
        sampled, accepted = honest(chunks, picks)
        for chunk in chunks:
            drafts, kept = chunk.draft_token_ids, accepted.get(chunk.request_id, ())
            if len(kept) < len(drafts) and rng.random() < 0.2:
                accepted[chunk.request_id] = (*kept, SampledToken(drafts[len(kept)]))
        return sampled, accepted

    monkeypatch.setattr(model_runner, "verify_drafts", lenient)
    model = MarkovLM()
    assert min(_p_values(model, _sampled_with_drafts(model))) < 1e-6
