"""`DiskTierStats`: what the disk tier reports (counters are monotonic since the tier was made)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskTierStats:
    num_lookups: int
    """Blocks asked of `load`."""
    num_hits: int
    """Of those, payloads returned (verified)."""
    num_writes: int
    """Blocks written to disk and indexed."""
    num_writes_dropped: int
    """Offers refused: queue full (disk slower than generation), degraded, or read-only."""
    num_evictions: int
    """Entries dropped for the byte budget (LRU) or with a reclaimed segment."""
    num_expirations: int
    num_checksum_failures: int
    """Records that failed verification on read (dropped, reported as misses)."""
    num_corrupt_records: int
    """Index entries that failed to decode (dropped unless read-only, reported as misses)."""
    num_index_repairs: int
    """Times the index was rebuilt from its block table, or set aside and started empty."""
    num_io_errors: int
    """Failures that degraded the tier (I/O errors, and any other error inside it)."""
    num_no_space: int
    """Writes that found the filesystem full (each lowered the budget and evicted)."""
    num_blocks: int
    live_bytes: int
    """Bytes of indexed records (headers included)."""
    disk_bytes: int
    """Bytes of segment files."""
    pending_bytes: int
    """Bytes waiting in the write-behind queue."""
    degraded: bool
    readonly: bool
    budget_bytes: int
    """The byte budget now: `max_bytes`, or less while the filesystem is short of space."""


def make_stats(
    counts: Mapping[str, int],
    num_blocks: int,
    live_bytes: int,
    disk_bytes: int,
    pending_bytes: int,
    degraded: bool,
    readonly: bool,
    budget_bytes: int,
) -> DiskTierStats:
    """The stats from the tier's counters (`Counters.snapshot`) and current sizes."""
    return DiskTierStats(
        num_lookups=counts["lookups"], num_hits=counts["hits"], num_writes=counts["writes"],
        num_writes_dropped=counts["dropped"], num_evictions=counts["evictions"],
        num_expirations=counts["expirations"], num_checksum_failures=counts["checksum"],
        num_corrupt_records=counts["corrupt"], num_index_repairs=counts["repairs"],
        num_io_errors=counts["io"], num_no_space=counts["no_space"], num_blocks=num_blocks,
        live_bytes=live_bytes, disk_bytes=disk_bytes, pending_bytes=pending_bytes,
        degraded=degraded, readonly=readonly, budget_bytes=budget_bytes,
    )  # fmt: skip


class Counters:
    """The tier's monotonic counters, added to from any thread."""

    NAMES = (
        "lookups", "hits", "writes", "dropped", "evictions", "expirations", "checksum", "corrupt",
        "repairs", "io", "no_space",
    )  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
