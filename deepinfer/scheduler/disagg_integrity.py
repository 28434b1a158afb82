"""The disaggregated scheduler's invariants, checked after every step in tests
(`DisaggScheduler.check_integrity`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.cache.free_queue import require
from deepinfer.request import RequestStatus

if TYPE_CHECKING:
    from deepinfer.scheduler.disagg import DisaggScheduler


def check_disagg_integrity(s: DisaggScheduler) -> None:
    """Queues partition the live requests; prefilling ones hold blocks for their whole prompt
    and match the planner; decoders have computed all but their last token."""
    s.kv.check_integrity()
    if s.split_pools:
        s.decode_kv.check_integrity()
    s.planner.check_integrity()
    decoding = [r.request_id for r in s.decoding]
    ids = decoding + list(s.prefilling) + [r.request_id for r in s.waiting]
    ids += [r.request_id for r in s.handoff_waiting] + list(s.handing_off)
    require(len(ids) == len(set(ids)), "a request is queued twice")
    require(set(ids) == set(s.queue.requests), "queues and the request table disagree")
    require(s.num_running <= s.max_num_seqs, "more running requests than max_num_seqs")
    planned = s.planner.queued_ids() | s.in_flight_prefill_ids()
    require(set(s.prefilling) == planned, "prefilling requests and the planner disagree")
    bs = s.kv.block_size
    for r in s.prefilling.values():
        require(r.status is RequestStatus.RUNNING, f"{r.request_id} prefills as {r.status}")
        short = s.kv.num_blocks_of(r.request_id) < -(-r.num_tokens // bs)
        require(not short, f"{r.request_id} holds too few blocks for its prompt")
        s.kv.check_window(r)
    for r in s.decoding:
        require(r.status is RequestStatus.RUNNING, f"{r.request_id} decodes as {r.status}")
        require(r.num_computed_tokens == r.num_tokens - 1, f"{r.request_id} out of step")
        stale = s.split_pools and s.kv.num_blocks_of(r.request_id) > 0
        require(not stale, f"{r.request_id} decodes holding prefill blocks")
        s.decode_kv.check_window(r)
    _check_handoffs(s)
    s.queue.check_integrity()
    for r in s.waiting:
        require(s.decode_kv.num_blocks_of(r.request_id) == 0, "waiting with decode blocks")


def _check_handoffs(s: DisaggScheduler) -> None:
    """Requests between the pools hold their prompt's prefill blocks; those with a copy ordered
    also hold exactly as many decode blocks."""
    bs = s.kv.block_size
    for r in [*s.handoff_waiting, *s.handing_off.values()]:
        require(r.status is RequestStatus.RUNNING, f"{r.request_id} hands off as {r.status}")
        require(r.num_computed_tokens == r.num_tokens - 1, f"{r.request_id} out of step")
        num_blocks = -(-r.num_computed_tokens // bs)
        require(s.kv.num_blocks_of(r.request_id) >= num_blocks, "handoff source freed")
        ordered = r.request_id in s.handing_off
        expected = num_blocks if ordered else 0
        require(s.decode_kv.num_blocks_of(r.request_id) == expected, "handoff blocks")
    require(s.ordered_handoff_ids <= set(s.handing_off), "a copy ordered for no handoff")
