"""What the lower KV tiers report: the host tier's and the disk tier's counters, and the disk
tier's contents per retention class.

A leaf: plain frozen dataclasses and nothing else (no lmdb, torch or aiofiles), so the API and
the engine's stats records name them without loading the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostTierStats:
    num_blocks: int
    """Blocks held now."""
    num_bytes: int
    """Bytes of payload held now (`num_blocks * payload_bytes`)."""
    capacity_bytes: int
    """The byte budget, rounded down to whole slots."""
    num_lookups: int
    """Blocks asked of `load` and `lease`."""
    num_hits: int
    """Of those, payloads handed out."""
    num_offers: int
    """Blocks stored by `offer` (offers of blocks already held are not counted)."""
    num_offers_dropped: int
    """Offers refused because every slot was leased or being filled."""
    num_evictions: int
    """Entries dropped (least recently used first) to make room for new ones."""


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


@dataclass(frozen=True)
class ClassSummary:
    name: str
    retention_s: float
    num_blocks: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    """Record bytes on disk (headers included)."""
    next_expiry_s: float | None = None
    """Wall-clock time the soonest entry expires (None: no entry)."""
    last_expiry_s: float | None = None


@dataclass(frozen=True)
class DiskSummary:
    classes: tuple[ClassSummary, ...]
    """Every configured class (empty ones too), then any other name found in the index."""
    num_segments: int
    max_bytes: int
    """The byte budget of segment files."""
