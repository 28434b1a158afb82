"""What the cache manager reports: its pools' use (`CacheUsage`) and where a chunk's KV lives
(`ChunkTables`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class CacheUsage:
    num_total_blocks: int
    """Usable blocks (the reserved null block excluded)."""
    num_used_blocks: int
    """Blocks referenced by at least one request."""
    num_free_blocks: int
    """Blocks allocatable now (some still hold cached content)."""
    num_cached_blocks: int
    """Blocks whose hash is registered (in use or free)."""
    num_query_tokens: int
    """Tokens of requests admitted (or readmitted after preemption) with prefix caching on."""
    num_hit_tokens: int
    """Of those, tokens served from cache (not computed again)."""
    num_window_blocks: int = 0
    """Usable blocks of the windowed layers' pool (0: the model has none)."""
    num_window_used_blocks: int = 0
    """Of those, blocks in some request's window."""


class ChunkTables(NamedTuple):
    """Where one chunk's KV lives: the full layers' block table, the windowed layers' (empty
    without a window group), and the end of the prefix whose full-layer K/V is cached and must
    not be rewritten (0: none; positions before it are replayed for the windowed layers)."""

    block_ids: tuple[int, ...]
    window_block_ids: tuple[int, ...]
    cached_until: int
