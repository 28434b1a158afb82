"""The disk tier of the prefix cache: block payloads in segment files, an LMDB index, retention
classes with wall-clock expiry, a byte budget, write-behind with back-pressure, crash safety."""

from deepinfer.tiers.disk.config import DiskTierConfig, default_cache_root
from deepinfer.tiers.disk.store import SweepResult
from deepinfer.tiers.disk.tier import DiskTier
from deepinfer.tiers.stats import DiskTierStats

__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "DiskTierStats",
    "SweepResult",
    "default_cache_root",
]
