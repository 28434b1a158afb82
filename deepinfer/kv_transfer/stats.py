"""`KVTransferStats`: a replica's KV transfers since start, for /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransferStats:
    num_pulls: int = 0
    """Requests that asked this replica (a consumer) to pull their prompt's blocks."""
    num_pulled_blocks: int = 0
    num_local_blocks: int = 0
    """Blocks a pull skipped: this replica had them cached already."""
    num_failed_pulls: int = 0
    """Pulls that registered nothing (the prompt was computed here)."""
    pull_seconds: float = 0.0
    """Time the pulls that read blocks took (handshake, read, release)."""
    num_quarantined_blocks: int = 0
    """Blocks set aside for good after a read NIXL could not stop."""
    num_held_blocks: int = 0
    """Blocks this replica (a producer) keeps now for consumers."""
    num_released: int = 0
    num_expired: int = 0
    """Holds that ended because no consumer released them in time."""
