"""Runs one `ScheduleOutput` through the model and the sampler. Called from the worker thread.

A step that samples constrained requests starts filling their allowed-token masks before its
forward pass, on the runner's fill pool, and the sampler waits for them only once the logits
are ready (`deepinfer/sampling/mask_fill.py` holds the design and its invariants)."""

from __future__ import annotations

import dataclasses
import time
from typing import cast

import torch

from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.protocol import CausalLM
from deepinfer.outputs import RunnerOutput, SampledToken
from deepinfer.request import Request
from deepinfer.runner.batch_builder import decode_batch, schedule_to_batch
from deepinfer.runner.prompt_logprobs import PromptLogprobTable
from deepinfer.runner.speculative import DrawnStreams, verify_drafts
from deepinfer.runner.step_graphs import StepGraphs
from deepinfer.runner.worker_draft import Drafter
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher
from deepinfer.sampling.generators import make_generator
from deepinfer.sampling.mask_fill import MaskFiller
from deepinfer.sampling.matchers import MatcherTable
from deepinfer.sampling.sampler import Sampler, SamplingRow
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput


class ModelRunner:
    """Owns the model, its KV tensors and per-request sampling state: seeded generators and
    grammar matchers (structured output), both moved with a request between runners.

    Each worker's thread calls `execute` (the two workers' steps may overlap); `release` is
    called between steps.
    """

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        device: torch.device,
        seed: int,
        graphs: StepGraphs | None = None,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.default_seed = seed
        self.graphs = graphs
        """Captured CUDA graphs (decode forwards, prefill pieces), replayed for the steps that fit
        them."""
        self.sampler = Sampler(seed=seed, device=device)
        self._generators: dict[str, torch.Generator] = {}
        self._decode_rows: dict[str, SamplingRow] = {}
        """A request's row for a plain decode (no drafts, past `min_tokens`): the same every
        step (it holds the request's own token lists), so made once, and kept until the request
        is released or its random stream moves (`take_generator`, `adopt_generator`)."""
        self.matchers = MatcherTable(constraints)
        """Grammar matchers of constrained requests, advanced by their steps' mask fills."""
        self.masks = MaskFiller(self.matchers, device)
        """Fills a step's masks while its forward pass runs."""
        self.drafter = drafter
        """Makes the drafts of chunks that ask the worker for them (`--speculative layers` or
        `draft-model`)."""
        self.prompt_logprobs = PromptLogprobTable()
        """Prompt logprobs of requests that asked, gathered until their first token."""

    @torch.inference_mode()
    def execute(self, so: ScheduleOutput) -> RunnerOutput:
        start = time.perf_counter()
        if so.is_empty:
            return RunnerOutput(step=so.step)
        drafted: dict[str, int] = {}
        if self.drafter is not None:
            so, drafted = self.drafter.fill(so)
        if so.plain_decodes:
            return self._decode_step(so, start)
        batch, sampled_ids = schedule_to_batch(so, self.block_size, self.device)
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, tuple[SampledToken, ...]] = {}
        if sampled_ids:
            sampling = [c for c in so.chunks if c.sample]
            verified = [(c.request, c.draft_token_ids) for c in sampling]
            with self.masks.fill(verified, self.model.arch.vocab_size) as mask:
                logits = self._forward(batch, so)  # [B_sample, V]
                rows = [row for c in sampling for row in self._rows(c)]
                streams = DrawnStreams.save(so.chunks, self._generators)
                tokens = self.sampler.sample(logits, rows, mask.wait() if mask else None)
            sampled, accepted = verify_drafts(so.chunks, tokens)
            streams.keep_used(accepted)
        else:
            self._forward(batch, so)
        prompt = self.prompt_logprobs.take(so.chunks)
        elapsed = time.perf_counter() - start
        return RunnerOutput(so.step, sampled, elapsed, accepted, drafted, prompt)

    def _decode_step(self, so: ScheduleOutput, start: float) -> RunnerOutput:
        """A step of plain decodes (`ScheduleOutput.plain_decodes`), the common one under load:
        list work over its requests, no call per chunk where the request's last step made its
        sampling row already."""
        requests = [c.request for c in so.chunks]
        ids = [r.request_id for r in requests]
        known = [self._decode_rows.get(rid) for rid in ids]
        rows = (
            [row for c in so.chunks for row in self._rows(c)]
            if None in known
            else cast(list[SamplingRow], known)
        )
        batch = decode_batch(so.chunks, requests, self.block_size, self.device)
        plain = [(r, ()) for r in requests]
        with self.masks.fill(plain, self.model.arch.vocab_size) as mask:
            logits = self._forward(batch, so)
            tokens = self.sampler.sample(logits, rows, mask.wait() if mask else None)
        sampled = dict(zip(ids, tokens, strict=True))
        return RunnerOutput(so.step, sampled, time.perf_counter() - start)

    def _forward(self, batch: ForwardBatch, so: ScheduleOutput) -> torch.Tensor:
        """The sampling rows' logits `[B_sample, V]`; a step with prompt rows scores them into
        `prompt_logprobs` on the way (eagerly: no graph was captured for extra rows)."""
        keep = self.drafter is not None and self.drafter.keeps_hidden
        if not batch.num_prompt_logits and not keep:
            if self.graphs is not None and (logits := self.graphs.run(batch)) is not None:
                return logits
            return self.model(batch)
        if keep:  # every row's final hidden state, for the drafter (`worker_mtp.py`)
            assert self.drafter is not None
            every = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
            rows = self.model.forward_hidden(dataclasses.replace(batch, logits_indices=every))
            self.drafter.record(so.chunks, rows)
            hidden = rows[batch.logits_indices]
        else:
            hidden = self.model.forward_hidden(batch)  # [B_sample + P, hidden]
        num_sampled = hidden.shape[0] - batch.num_prompt_logits
        if batch.num_prompt_logits:
            self.prompt_logprobs.add(so.chunks, hidden[num_sampled:], self.model.compute_logits)
        return self.model.compute_logits(hidden[:num_sampled])

    def _rows(self, chunk: ScheduledChunk) -> list[SamplingRow]:
        """The sampling rows of a sampling chunk: one, or with drafts one per position, each
        seeing the outputs before it (the drafts before its position count as outputs: they
        are, whenever the row's pick is kept)."""
        request, drafts = chunk.request, chunk.draft_token_ids
        params, outputs = request.sampling, request.output_token_ids
        generator = self._generator(request)
        if not drafts and len(outputs) >= params.min_tokens:
            return [self._decode_row(request, generator)]
        rows = []
        for j in range(1 + len(drafts)):
            # penalties read the tokens; `min_tokens` only their number
            seen = [*outputs, *drafts[:j]] if j and params.needs_penalties else outputs
            early = len(outputs) + j < params.min_tokens
            suppress = request.stop_token_ids if early else frozenset()
            rows.append(
                SamplingRow(
                    params=params,
                    output_token_ids=seen,
                    prompt_token_ids=request.prompt_token_ids,
                    generator=generator,
                    suppress_token_ids=suppress,
                )
            )
        return rows

    def _decode_row(self, request: Request, generator: torch.Generator | None) -> SamplingRow:
        row = self._decode_rows.get(request.request_id)
        if (
            row is None
            or row.params is not request.sampling
            or row.output_token_ids is not request.output_token_ids
            or row.prompt_token_ids is not request.prompt_token_ids
            or row.generator is not generator
        ):
            row = SamplingRow(
                params=request.sampling,
                output_token_ids=request.output_token_ids,
                prompt_token_ids=request.prompt_token_ids,
                generator=generator,
            )
            self._decode_rows[request.request_id] = row
        return row

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling.seed
        if seed is None or request.sampling.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = make_generator(seed, self.default_seed, 0, self.device)
            self._generators[request.request_id] = gen
        return gen

    def take_generator(self, request_id: str) -> torch.Generator | None:
        """Hand a request's random stream over to another runner (KV handoff across devices)."""
        self._decode_rows.pop(request_id, None)
        return self._generators.pop(request_id, None)

    def adopt_generator(self, request_id: str, generator: torch.Generator | None) -> None:
        """Continue a request's random stream here, moved to this runner's device if needed
        (the state carries over: the draws go on as if one runner had made them all)."""
        self._decode_rows.pop(request_id, None)
        if generator is None:
            return
        here, there = self.device, generator.device
        if (there.type, there.index or 0) != (here.type, here.index or 0):
            moved = torch.Generator(device=self.device)
            moved.set_state(generator.get_state())
            generator = moved
        self._generators[request_id] = generator

    def take_matcher(self, request_id: str) -> ConstraintMatcher | None:
        """Hand a request's grammar state over to another runner (with its random stream)."""
        return self.matchers.take(request_id)

    def adopt_matcher(self, request_id: str, matcher: ConstraintMatcher | None) -> None:
        """Continue a request's grammar state here (it is plain host state: nothing moves)."""
        self.matchers.adopt(request_id, matcher)

    def close(self) -> None:
        """Stop the threads the runner owns (blocking: after the last step)."""
        self.masks.close()

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' sampling state."""
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._decode_rows.pop(rid, None)
        self.prompt_logprobs.release(request_ids)
        self.matchers.release(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)
