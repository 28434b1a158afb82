"""The disk tier's counters and the `DiskTierStats` made from them (counters are monotonic since
the tier was made)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from deepinfer.tiers.stats import DiskTierStats


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
