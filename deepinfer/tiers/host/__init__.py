"""The host-RAM tier of the prefix cache: block payloads in (optionally page-locked) memory,
LRU within a byte budget, shared by the event loop and worker threads."""

from deepinfer.tiers.host.arena import SlotArena, allocate_bytearray
from deepinfer.tiers.host.tier import HostTier
from deepinfer.tiers.stats import HostTierStats

__all__ = ["HostTier", "HostTierStats", "SlotArena", "allocate_bytearray"]
