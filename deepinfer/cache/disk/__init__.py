"""The disk tier of the prefix cache: block payloads in segment files, an LMDB index, retention
classes with wall-clock expiry, a byte budget, write-behind with back-pressure, crash safety."""

from deepinfer.cache.disk.config import DiskTierConfig, default_cache_root
from deepinfer.cache.disk.store import SweepResult
from deepinfer.cache.disk.tier import DiskTier, DiskTierStats

__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "DiskTierStats",
    "SweepResult",
    "default_cache_root",
]
