"""`EngineCore`: the synchronous heart (scheduler + cache manager + runner), no asyncio.

`AsyncEngine` drives it from the event loop: each scheduler lane (prefill and decode, or one
colocated lane) has a worker that runs `execute` on its own thread. Tests and offline users may
call `step()` directly.

The core is constructed from `EngineParts` (`engine/build.py` builds them from a `Config`). With
separate device groups (`runner/device_groups.py`) the parts hold two model replicas and two KV
pools: the prefill pool (prefix cache, host and disk tiers) and the decode pool. A prefilled
request's KV is copied from one to the other (`drain_handoffs`, `copy_kv`, `complete_handoff`).
"""

from __future__ import annotations

import torch

from deepinfer.config import Config
from deepinfer.engine.build import EngineParts, RuntimeInfo, build_engine
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import Request
from deepinfer.scheduler.output import KVHandoff, ScheduleOutput, StepKind
from deepinfer.scheduler.prefill_types import PlannerStats
from deepinfer.scheduler.protocol import StepLane

__all__ = ["EngineCore", "RuntimeInfo"]


class EngineCore:
    def __init__(self, config: Config, parts: EngineParts | None = None) -> None:
        """The core over `parts` (see `EngineParts` for what each is); without them, builds them
        from `config` (`build_engine`: blocking, it loads the model)."""
        parts = parts if parts is not None else build_engine(config)
        self.config = config
        self.info: RuntimeInfo = parts.info
        self.groups = parts.groups
        self.tokenizer = parts.tokenizer
        self.recipe = parts.recipe
        self.kv = parts.kv
        self.decode_kv = parts.decode_kv
        self.tiers = parts.tiers
        """The host and disk tiers under the prefill pool (fill on submit, write-behind)."""
        self.scheduler = parts.scheduler
        self.lanes: tuple[StepLane, ...] = self.scheduler.lanes()
        """One lane (colocated) or two (prefill, decode); each is run by one worker."""
        self.constraints = parts.constraints
        self.runner = parts.runner
        self.decode_runner = parts.decode_runner
        self._copier = parts.copier
        self.experts = parts.experts
        self.kv_transfer = parts.kv_transfer
        """KV transfers with other replicas (None: off)."""
        self._tensor_parallel = parts.tensor_parallel

    def lane_device(self, kind: StepKind) -> torch.device:
        """The device a lane's steps run on."""
        return self.groups.decode if kind is StepKind.DECODE else self.groups.prefill

    # -- a step of each lane: schedule and update on the caller's thread, execute anywhere --
    def execute(self, so: ScheduleOutput) -> RunnerOutput:
        runner = self.decode_runner if so.kind is StepKind.DECODE else self.runner
        return runner.execute(so)

    def update(self, lane: StepLane, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        deltas = lane.update(so, out)
        finished = [c.request for c in so.chunks if c.request.is_finished]
        if self.kv_transfer is not None:
            for request in finished:  # before any other step can reuse their freed blocks
                self.kv_transfer.finished(request)
        self._release([r.request_id for r in finished])
        return deltas

    def fail(self, lane: StepLane, so: ScheduleOutput) -> list[str]:
        """A step of `lane` failed (execute, or update part way): finish its requests, free
        their blocks and sampling state. Returns the ids whose outputs must end with an error
        (see `StepLane.fail`). Raises if the scheduler is left inconsistent: the engine cannot go on."""
        failed = lane.fail(so)
        self._release([c.request_id for c in so.chunks if c.request.is_finished])
        self.check_integrity()
        return failed

    def _release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)
        if self.decode_runner is not self.runner:
            self.decode_runner.release(request_ids)

    def step(self) -> list[TokenDelta]:
        """One step of each lane in turn, then any KV handoffs (offline use and tests; the
        async engine overlaps the lanes' steps and the copies instead)."""
        deltas: list[TokenDelta] = []
        for lane in self.lanes:
            if lane.has_work:
                so = lane.schedule()
                deltas += self.update(lane, so, self.execute(so))
        for handoff in self.drain_handoffs():
            self.copy_kv(handoff)
            self.complete_handoff(handoff)
        return deltas

    # -- KV handoffs between the pools of separate device groups --
    def drain_handoffs(self) -> list[KVHandoff]:
        """Copies to run now (call on the loop, after any change): see `DisaggScheduler`."""
        return self.scheduler.drain_handoffs()

    def copy_kv(self, handoff: KVHandoff) -> None:
        """Run one handoff's copy to completion (blocking: on the transfer thread)."""
        assert self._copier is not None, "no separate decode pool"
        self._copier.copy(handoff.src_block_ids, handoff.dst_block_ids)

    def complete_handoff(self, handoff: KVHandoff) -> None:
        """After `copy_kv`: the request decodes on the decode device from now on (its random
        stream moves with it), unless it was aborted meanwhile."""
        rid = handoff.request_id
        self.decode_runner.adopt_generator(rid, self.runner.take_generator(rid))
        self.decode_runner.adopt_matcher(rid, self.runner.take_matcher(rid))
        if not self.scheduler.complete_handoff(rid):
            self._release([rid])

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        aborted = self.scheduler.abort(request_id)
        if self.scheduler.get_request(request_id) is None:  # else deferred to its step or copy
            self._release([request_id])
        return aborted

    def close(self) -> None:
        """Stop the runners' threads, write what the disk tier has queued and stop its writer
        (blocking)."""
        self.runner.close()
        if self.decode_runner is not self.runner:
            self.decode_runner.close()
        self.tiers.close()
        if self.experts is not None:
            self.experts.close()
        if self._tensor_parallel is not None:
            self._tensor_parallel.close()
        self.constraints.close()

    def prefill_stats(self) -> PlannerStats | None:
        """The prefill planner's queues and cost model (disaggregated mode only)."""
        return self.scheduler.planner_stats()

    def expert_load(self) -> tuple[tuple[int, ...], ...]:
        """Tokens routed to each expert of each layer, over every model replica (empty for a
        dense model)."""
        models = {id(r.model): r.model for r in (self.runner, self.decode_runner)}
        per_model = [m.expert_load() for m in models.values() if hasattr(m, "expert_load")]
        if not per_model:
            return ()
        return tuple(
            tuple(map(sum, zip(*layer, strict=True))) for layer in zip(*per_model, strict=True)
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.tiers.check_integrity()
