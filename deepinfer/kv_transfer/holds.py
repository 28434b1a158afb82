"""`KVHolds`: the producer's side. When a request sent with `do_remote_decode` finishes, the
prompt's leading full blocks still cached are pinned for a consumer to pull, until it releases
them or `hold_s` passes. Runs where the scheduler runs (the event loop, or the caller of
`EngineCore.step`): pins and releases change the pool's free queue."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.request import Request
from deepinfer.tiers.device_blocks import TierBlocks


@dataclass(frozen=True)
class Held:
    """What a finished request left for its consumer."""

    block_ids: list[int]
    last_hash: BlockHash | None
    """The chained hash of the last kept block (None: nothing kept)."""


@dataclass
class _Hold:
    held: Held
    pin: int | None
    deadline: float


class KVHolds:
    def __init__(
        self, blocks: TierBlocks, hold_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._blocks = blocks
        self._hold_s = hold_s
        self._clock = clock
        self._holds: dict[str, _Hold] = {}
        self.num_released = 0
        self.num_expired = 0

    def hold(self, request: Request) -> Held:
        """Pin the prompt's leading cached full blocks for `request.request_id`."""
        self.expire()
        hashes = self._blocks.prompt_hashes(request)
        block_ids = self._blocks.cached_blocks(hashes)
        pin = self._blocks.pin(block_ids) if block_ids else None
        held = Held(block_ids, hashes[len(block_ids) - 1] if block_ids else None)
        self._holds[request.request_id] = _Hold(held, pin, self._clock() + self._hold_s)
        return held

    def get(self, request_id: str) -> Held | None:
        hold = self._holds.get(request_id)
        return hold.held if hold is not None else None

    def release(self, request_id: str) -> bool:
        """Unpin; True if the blocks were still kept (so a pull that finished before this read
        them intact)."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self._unpin(hold)
        self.num_released += 1
        return True

    def expire(self) -> None:
        now = self._clock()
        for rid in [rid for rid, h in self._holds.items() if h.deadline <= now]:
            self._unpin(self._holds.pop(rid))
            self.num_expired += 1

    def _unpin(self, hold: _Hold) -> None:
        if hold.pin is not None:
            self._blocks.unpin(hold.pin)

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.held.block_ids) for h in self._holds.values())

    def close(self) -> None:
        for rid in list(self._holds):
            self._unpin(self._holds.pop(rid))
