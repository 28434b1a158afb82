"""A fake runner that simulates the paged KV pool, so scheduler tests check what the KV holds.

Each KV slot stores (position, digest of all tokens up to and including it): what a real model's
KV at that position depends on. Before computing a chunk, the runner checks that every earlier
position of the request reads back the right content through the chunk's block table, from the
pool as it was before the step (a step may not read what the same step writes). A prefix hit on
a wrong block, a block reused while still in use, or a lost write all fail here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import msgspec

from deepinfer.outputs import RunnerOutput, SampledToken
from deepinfer.request import Request, SamplingParams
from deepinfer.runner.speculative import verify_drafts
from deepinfer.scheduler.draft_gate import Draft
from deepinfer.scheduler.output import ScheduleOutput

_MOD = (1 << 61) - 1


def prefix_digests(token_ids: Sequence[int]) -> list[int]:
    """digests[p] depends on token_ids[: p + 1] (a rolling polynomial hash)."""
    out, h = [], 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(digest: int, vocab: int) -> int:
    """The fake model: the next token is a fixed function of all previous tokens."""
    return (digest * 2_654_435_761 >> 7) % vocab


def reference_output(req: Request, vocab: int) -> list[int]:
    """What the fake model generates for `req` run alone, token by token."""
    tokens = list(req.prompt_token_ids)
    out: list[int] = []
    stop = req.stop_token_ids
    while True:
        tok = next_token(prefix_digests(tokens)[-1], vocab)
        out.append(tok)
        tokens.append(tok)
        if len(out) > req.sampling.min_tokens and tok in stop:
            return out
        if len(out) >= req.sampling.max_tokens:
            return out


class FakeRunner:
    def __init__(self, block_size: int, vocab: int = 50) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.num_steps = 0

    def run(self, so: ScheduleOutput) -> RunnerOutput:
        bs = self.block_size
        before = dict(self.kv)
        written: set[tuple[int, int]] = set()
        picks: list[SampledToken] = []
        so, drafted = fill_worker_drafts(so, self.vocab)
        for chunk in so.chunks:
            context = chunk.request.all_token_ids[: chunk.start_position] + chunk.token_ids()
            digests = prefix_digests(context)  # drafts included: rejected ones write wrong KV
            table = chunk.block_ids
            assert len(table) >= -(-chunk.end_position // bs), "block table too short"
            assert 0 not in table, "the null block was handed out"
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for p in range(chunk.start_position):
                got = before.get((table[p // bs], p % bs))
                assert got == (p, digests[p]), f"{chunk.request_id}: wrong KV at position {p}"
            for p in range(chunk.start_position, chunk.end_position):
                slot = (table[p // bs], p % bs)
                assert slot not in written, f"two chunks write slot {slot} in one step"
                written.add(slot)
                self.kv[slot] = (p, digests[p])
            if chunk.sample:  # one pick per row of logits: the last token's, or every draft's
                rows = digests[len(digests) - chunk.num_logits :]
                picks += [SampledToken(next_token(d, self.vocab), logprob=-1.0) for d in rows]
        sampled, accepted = verify_drafts(so.chunks, picks)
        self.num_steps += 1
        elapsed = 0.001 * so.num_batched_tokens + 0.002
        return RunnerOutput(so.step, sampled, elapsed, accepted, drafted)


class FakeProposer:
    """Drafts that follow the fake model for a random number of tokens, then go astray; with
    `on_worker`, the room for them only (the fake runner drafts: `fill_worker_drafts`)."""

    name = "fake"
    num_signals = 0
    max_draft_tokens: int | None = None

    def __init__(self, rng: random.Random, vocab: int, on_worker: bool = False) -> None:
        self.rng, self.vocab, self.on_worker = rng, vocab, on_worker

    def propose(self, request: Request, max_tokens: int) -> Draft:
        k = self.rng.randint(0, max_tokens)
        if self.on_worker:
            return Draft(num_worker_tokens=k)
        return Draft(fake_drafts(request.all_token_ids, k, self.vocab, self.rng))

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def fake_drafts(tokens: Sequence[int], k: int, vocab: int, rng: random.Random) -> tuple[int, ...]:
    """k drafts after `tokens`: the fake model's own for a random number, then maybe not."""
    context, drafts = list(tokens), []
    good = rng.randint(0, k)
    for j in range(k):
        right = next_token(prefix_digests(context)[-1], vocab)
        drafts.append(right if j < good else rng.choice([right, rng.randrange(vocab)]))
        context.append(drafts[-1])
    return tuple(drafts)


def fill_worker_drafts(so: ScheduleOutput, vocab: int) -> tuple[ScheduleOutput, dict[str, int]]:
    """The runner's part for a worker proposer: each chunk's asked-for drafts made, sometimes
    fewer than its slots (a drafter unsure of the rest, or still catching up: the chunk shrinks
    to them), seeded by the step and the request so that a rerun drafts the same; and how many
    each got."""
    chunks, drafted = [], {}
    for c in so.chunks:
        if c.num_worker_drafts:
            rng = random.Random(f"{so.step}:{c.request_id}")
            context = c.request.all_token_ids[: c.start_position + 1]
            k = c.num_worker_drafts if rng.random() < 0.5 else rng.randint(0, c.num_worker_drafts)
            drafts = fake_drafts(context, k, vocab, rng)
            c = dataclasses.replace(
                c, draft_token_ids=drafts, num_worker_drafts=0, num_new_tokens=1 + k
            )
            drafted[c.request_id] = k
        chunks.append(c)
    return msgspec.structs.replace(so, chunks=tuple(chunks)), drafted


def make_request(
    rid: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    eos: frozenset[int] = frozenset(),
    salt: str | None = None,
    **sampling: object,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, list(prompt), params, eos_token_ids=eos, cache_salt=salt)
