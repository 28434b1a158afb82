"""`DiskTierConfig`: the disk tier's settings, and where its files live.

Layout under the cache root (one subdirectory per model fingerprint, so a different model, dtype,
block size or KV layout never even opens another's files; the hash seed keeps them apart as well):

    <root>/<sha256(fingerprint)[:32]>/fingerprint   the fingerprint string, for humans
    <root>/<...>/index/                             LMDB environment (block hash -> record)
    <root>/<...>/segments/<id>.seg                  append-only segment files
    <root>/<...>/writer.lock                        flock held by the one writing process
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepinfer.config import Retention
from deepinfer.errors import InvalidRequestError

DAY_S = 86400.0


def default_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deepinfer"


def fingerprint_dir(root: Path, fingerprint: str) -> Path:
    """The subdirectory holding one model fingerprint's index and segments."""
    return root / hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class DiskTierConfig:
    cache_dir: Path | None = None
    """Cache root (`--cache-dir`); None: `default_cache_root()`."""
    max_bytes: int = 32 << 30
    """Byte budget for segment files; LRU eviction beyond it (lowered while the disk is full)."""
    segment_bytes: int = 64 << 20
    """A segment file is closed and a new one started once it reaches this size."""
    retention_s: tuple[tuple[str, float], ...] = (
        (Retention.AGENT, 3 * DAY_S),
        (Retention.CHAT, 7 * DAY_S),
    )
    """Retention classes and their lifetimes in seconds (wall clock; a hit restarts the clock)."""
    default_retention: str = Retention.CHAT
    """Class used when a request names none (`none` disables disk writes by default)."""
    max_pending_bytes: int = 256 << 20
    """Write-behind queue bound: offers beyond it are dropped and counted, never waited for."""
    max_batch_blocks: int = 64
    """Most blocks written (then fsynced, then indexed) in one batch."""
    sweep_interval_s: float = 60.0
    """Period of the background sweep (expiry, byte budget, segment reclaim)."""
    reclaim_live_fraction: float = 0.5
    """A closed segment whose live bytes fall below this fraction of its size is compacted: its
    live blocks are copied to the active segment (metadata kept) and the file deleted."""
    index_map_bytes: int | None = None
    """LMDB map size; None: sized from `max_bytes` (sparse, so generous costs nothing)."""
    retry_degraded_s: float = 1.0
    """After a failure (opening, an I/O error, a misbehaving index) the tier is degraded for
    this long, then tries again; each failed retry doubles the wait, up to `retry_max_s`."""
    retry_max_s: float = 60.0
    """Longest wait between retries of a degraded tier."""

    def __post_init__(self) -> None:
        if self.max_bytes < 2 * self.segment_bytes:
            raise InvalidRequestError(
                f"disk cache max_bytes ({self.max_bytes}) must hold at least two segments of "
                f"{self.segment_bytes} bytes: raise max_bytes or lower segment_bytes",
                param="max_bytes",
            )
        names = [name for name, _ in self.retention_s]
        if Retention.NONE in names or len(set(names)) != len(names):
            raise InvalidRequestError(
                f"retention classes must be unique and not {Retention.NONE.value!r}, got {names}",
                param="retention_s",
            )
        if any(ttl <= 0 for _, ttl in self.retention_s):
            raise InvalidRequestError("retention lifetimes must be positive", param="retention_s")
        self.ttl_s(self.default_retention)
        if not 0.0 < self.retry_degraded_s <= self.retry_max_s:
            raise InvalidRequestError(
                "retry_degraded_s must be positive and at most retry_max_s",
                param="retry_degraded_s",
            )
        if not 0.0 <= self.reclaim_live_fraction < 1.0:
            raise InvalidRequestError(
                "reclaim_live_fraction must be in [0, 1)", param="reclaim_live_fraction"
            )

    def root(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else default_cache_root()

    def map_bytes(self) -> int:
        if self.index_map_bytes is not None:
            return self.index_map_bytes
        return max(64 << 20, self.max_bytes // 16)

    def ttl_s(self, retention: str) -> float | None:
        """Lifetime of a retention class; None for `none`. Unknown names raise."""
        if retention == Retention.NONE:
            return None
        for name, ttl in self.retention_s:
            if name == retention:
                return ttl
        known = [str(name) for name, _ in self.retention_s] + [Retention.NONE.value]
        raise InvalidRequestError(
            f"unknown retention class {retention!r}; choose one of {known}", param="retention"
        )
