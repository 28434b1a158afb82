"""Length buckets for prefill: requests grouped by how many prompt tokens they must compute.

A request's bucket is fixed when it is queued, from its uncached token count then (prompt minus
prefix-cache hit). It keeps that bucket while its chunks run, so a long prompt near its end does
not start competing with short ones for their priority, and each bucket is one FIFO queue.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from deepinfer.errors import ConfigError

DEFAULT_BOUNDARIES: tuple[int, ...] = (512, 4096, 32768)


class LengthBuckets:
    """Bucket `i` holds uncached counts in (boundaries[i-1], boundaries[i]]; the last bucket
    everything above the last boundary. So `len(boundaries) + 1` buckets."""

    def __init__(self, boundaries: tuple[int, ...] = DEFAULT_BOUNDARIES) -> None:
        if not boundaries:
            raise ConfigError("prefill bucket boundaries must name at least one length")
        if boundaries[0] < 1 or any(a >= b for a, b in itertools.pairwise(boundaries)):
            raise ConfigError(
                f"prefill bucket boundaries must be positive and strictly increasing, got {boundaries}"
            )
        self.boundaries = tuple(boundaries)

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    def index(self, num_uncached_tokens: int) -> int:
        """The bucket of a request with `num_uncached_tokens` (>= 1) tokens to compute."""
        assert num_uncached_tokens >= 1, "a queued prefill has at least one token to compute"
        return bisect.bisect_left(self.boundaries, num_uncached_tokens)

    def label(self, index: int) -> str:
        """Human name of a bucket, e.g. `<=512` or `>32768` (metrics)."""
        if index < len(self.boundaries):
            return f"<={self.boundaries[index]}"
        return f">{self.boundaries[-1]}"


@dataclass
class PrefillEntry:
    """Planner-side state of one queued prefill. Mutable: only the planner advances it.

    Invariant: `num_computed_tokens < num_tokens` while queued (done ones leave)."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    bucket: int
    added_step: int
    """The planner step count when queued (plans made before it do not count as waiting)."""
    first_planned_step: int = -1
    """The step of its first chunk; -1 while never planned."""

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


class BucketQueues:
    """One FIFO queue per bucket, plus an id index. Order within a bucket is arrival order."""

    def __init__(self, num_buckets: int) -> None:
        self._queues: list[deque[PrefillEntry]] = [deque() for _ in range(num_buckets)]
        self._by_id: dict[str, PrefillEntry] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def ids(self) -> set[str]:
        return set(self._by_id)

    def get(self, request_id: str) -> PrefillEntry | None:
        return self._by_id.get(request_id)

    def push(self, entry: PrefillEntry) -> None:
        assert entry.request_id not in self._by_id, "duplicate prefill entry"
        self._queues[entry.bucket].append(entry)
        self._by_id[entry.request_id] = entry

    def pop(self, request_id: str) -> PrefillEntry | None:
        """Remove a request wherever it is; None if it is not queued."""
        entry = self._by_id.pop(request_id, None)
        if entry is not None:
            self._queues[entry.bucket].remove(entry)
        return entry

    def bucket(self, index: int) -> Iterator[PrefillEntry]:
        """The bucket's entries, oldest first (a snapshot: safe to pop while iterating)."""
        return iter(list(self._queues[index]))

    def is_empty(self, index: int) -> bool:
        return not self._queues[index]

    def head(self, index: int) -> PrefillEntry | None:
        queue = self._queues[index]
        return queue[0] if queue else None

    def depths(self) -> tuple[int, ...]:
        return tuple(len(q) for q in self._queues)

    def queued_tokens(self) -> tuple[int, ...]:
        return tuple(sum(e.num_remaining_tokens for e in q) for q in self._queues)

    def check_integrity(self) -> None:
        seen = [e.request_id for q in self._queues for e in q]
        assert len(seen) == len(set(seen)), "a request is queued twice"
        assert set(seen) == set(self._by_id), "queues and the id index disagree"
        for i, q in enumerate(self._queues):
            for e in q:
                assert e.bucket == i, f"{e.request_id} sits in bucket {i}, not {e.bucket}"
                assert 0 <= e.num_computed_tokens < e.num_tokens, f"{e.request_id} done"
