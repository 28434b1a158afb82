"""Decode steps, as both schedulers make and apply them: a decoder's chunk (its last token, and
any drafts), the disaggregated decode lane's plan, and a sampling chunk's result applied."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepinfer.cache.manager import KVCacheManager
from deepinfer.outputs import RunnerOutput, SampledToken, TokenDelta
from deepinfer.request import FinishReason, Request
from deepinfer.scheduler.draft_gate import Draft
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import ScheduledChunk
from deepinfer.scheduler.stop import check_finished
from deepinfer.scheduler.token_delta import take_tokens, token_delta

NO_DRAFT = Draft()


def decode_chunk(request: Request, kv: KVCacheManager, draft: Draft = NO_DRAFT) -> ScheduledChunk:
    """A decoder's chunk: its last token, then its drafts (slots already allocated)."""
    start = request.num_computed_tokens
    assert start == request.num_tokens - 1, "a decoder computes exactly its last token"
    if draft is NO_DRAFT and kv.window is None:  # most chunks: no drafts, one block table
        return ScheduledChunk(request, start, 1, kv.block_ids(request.request_id), True)
    size = draft.size
    tables = kv.chunk_tables(request, start + 1 + size)
    # Positional (the fields in order): made for every decoder every step, and keywords cost
    # more than the rest of the construction.
    return ScheduledChunk(
        request,
        start,
        1 + size,
        tables.block_ids,
        True,
        draft.token_ids,
        draft.num_worker_tokens,
        tables.window_block_ids,
        tables.cached_until,
    )


def plan_decodes(
    decoding: list[Request],
    kv: KVCacheManager,
    drafter: Drafter | None,
    max_request_tokens: int,
    preempt: Callable[[Request], None],
) -> tuple[list[ScheduledChunk], list[str]]:
    """Every decoder's chunk, oldest first, and the ids preempted for them: a decoder short of a
    block preempts the newest (popped from `decoding`, handed to `preempt`), maybe itself.
    Drafts get slots only where a block stays free for each decoder after theirs."""
    drafted = drafter.plan(decoding, max_request_tokens) if drafter is not None else {}
    chunks: list[ScheduledChunk] = []
    preempted: list[str] = []
    plain = not drafted and kv.window is None
    allocate, block_ids = kv.allocate_slots, kv.block_ids
    i = 0
    while i < len(decoding):
        request = decoding[i]
        if plain and allocate(request, 1):  # most decoders: one token, its block table
            start = request.num_computed_tokens
            chunks.append(ScheduledChunk(request, start, 1, block_ids(request.request_id), True))
            i += 1
            continue
        if (
            drafter is not None
            and (draft := drafted.get(request.request_id)) is not None
            and drafter.take_slots(kv, request, draft, reserve_blocks=len(decoding) - i - 1)
        ):
            chunks.append(decode_chunk(request, kv, draft))
            i += 1
            continue
        while not allocate(request, 1):
            victim = decoding.pop()
            preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                break
        else:
            chunks.append(decode_chunk(request, kv))
            i += 1
    return chunks, preempted


def apply_sampling(
    chunk: ScheduledChunk,
    out: RunnerOutput,
    kv: KVCacheManager,
    drafter: Drafter | None,
    max_model_len: int,
) -> tuple[Sequence[SampledToken], FinishReason | None]:
    """A sampling chunk's result: its tokens appended (`take_tokens`), the drafts' fate told to
    the drafter, the computed prefix advanced and its full blocks cached. Computed: the chunk's
    tokens but its drafts, then the accepted drafts (the tokens taken after the first); a
    rejected draft's KV lies past them, never cached. The caller finishes the request."""
    request = chunk.request
    if chunk.num_new_tokens == 1 and not out.accepted:  # most chunks: one token, no drafts
        token = out.sampled[request.request_id]
        request.output_token_ids.append(token.token_id)
        request.num_computed_tokens = chunk.start_position + 1
        kv.cache_blocks(request)
        return (token,), check_finished(request, max_model_len)
    taken, reason = take_tokens(request, out, max_model_len)
    num_drafts = len(chunk.draft_token_ids) + chunk.num_worker_drafts
    if drafter is not None and num_drafts:
        verified = out.drafted.get(request.request_id, num_drafts)
        drafter.observe_request(request, verified, out)
    end = chunk.start_position + chunk.num_new_tokens
    request.num_computed_tokens = end - num_drafts + len(taken) - 1
    kv.cache_blocks(request)
    return taken, reason


def apply_decodes(
    chunks: Sequence[ScheduledChunk], out: RunnerOutput, kv: KVCacheManager, max_model_len: int
) -> tuple[list[TokenDelta], list[tuple[Request, FinishReason]]]:
    """`apply_sampling` of a step of plain decodes (`ScheduleOutput.plain_decodes`), in one
    loop: each request's token appended, its prefix advanced and its full blocks cached; every
    request's delta, and the requests to finish with their reasons (the caller finishes them,
    after the loop)."""
    sampled = out.sampled
    cache_blocks = kv.cache_blocks
    deltas: list[TokenDelta] = []
    finished: list[tuple[Request, FinishReason]] = []
    for chunk in chunks:
        request = chunk.request
        token = sampled[request.request_id]
        request.output_token_ids.append(token.token_id)
        request.num_computed_tokens = chunk.start_position + 1
        cache_blocks(request)
        reason = check_finished(request, max_model_len)
        if reason is not None:
            finished.append((request, reason))
        deltas.append(token_delta(request, (token,), reason))
    return deltas, finished
