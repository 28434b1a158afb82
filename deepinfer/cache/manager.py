"""`KVCacheManager`: the scheduler's only door to KV blocks (per-request block tables, prefix hits).

Lifecycle of a request's blocks, driven by the scheduler:

1. `get_computed_blocks(req)` on admission: the longest run of cached full blocks matching the
   request's tokens (never all of them: the last token is always computed, to get logits;
   none for a request that needs its prompt's logits, `Request.needs_prompt_logits`).
2. `allocate_slots(req, n, hit_blocks)`: take references on the hits and allocate blocks so that
   the first `num_computed + n` tokens have room. Returns False (changing nothing) when the pool
   is short: the scheduler then preempts or waits.
3. `cache_blocks(req)` after the step that computed the tokens: register the hashes of the blocks
   that became full and computed. Registration waits for the computation on purpose: a block is
   never visible to other requests before its KV exists, whatever the runner does within a step
   (separate prefill and decode passes, split batches, overlapped steps).
   Meanwhile the blocks are *claimed* (`claim_prompt_blocks` on admission): a request whose next
   uncached block another request is computing (`computing_elsewhere`) waits for it and then
   hits, so a shared prefix in flight is computed once.
4. `free(req)` on finish, abort or preemption: blocks return to the LRU free queue with their
   content and hashes, so a preempted request's recompute and a follow-up turn hit them.

A model with sliding-window layers adds a second group (`WindowGroup`, its own pool): the
windowed layers' blocks, only each request's current window, allocated per chunk by
`chunk_tables`. A prefix hit then may start computing before its end (a stored window or a
bounded replay, see `cache/window_group.py`); the full layers' cached K/V up to the hit's end
is read, never rewritten (`ChunkTables.cached_until`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepinfer.block_ids import BlockIds
from deepinfer.cache.block_hash import BlockHash, extend_block_hashes, seed_bytes
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.block_tables import BlockTables
from deepinfer.cache.claims import PromptClaims
from deepinfer.cache.free_queue import Block, require
from deepinfer.cache.held_blocks import HeldBlocks
from deepinfer.cache.usage import CacheUsage, ChunkTables
from deepinfer.cache.window_group import WindowGroup, WindowSpec
from deepinfer.kv_events.recorder import BlockOrigin, MediumEvents
from deepinfer.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_seed: str,
        enable_prefix_caching: bool = True,
        *,
        track_new_blocks: bool = False,
        window: WindowSpec | None = None,
        num_window_blocks: int = 0,
        events: MediumEvents | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._seed = seed_bytes(hash_seed)
        self._blocks = BlockTables()
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        """Leading blocks of each request already offered to the cache map."""
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.track_new_blocks = track_new_blocks
        """When set (a lower tier is attached), newly registered blocks are recorded for it."""
        self._new_blocks: list[tuple[int, BlockHash, str | None]] = []
        self._new_windows: list[tuple[list[tuple[int, BlockHash]], str | None]] = []
        self.held = HeldBlocks(self.pool)
        """Blocks held outside any request: reserved for the lower tiers to fill, or pinned while
        they copy them out (see `tiers/device_blocks.py`)."""
        self._claims = PromptClaims()
        self.window = (
            WindowGroup(window, num_window_blocks, block_size, enable_prefix_caching)
            if window is not None
            else None
        )
        """The windowed layers' blocks (None: every layer keeps every token here)."""
        self.events = events
        """The device pool's KV events (None: off): registrations here, evictions in the pool."""
        self.pool.events = events
        self._new_origins: dict[BlockHash, BlockOrigin] = {}
        """With events on and a lower tier attached: what the tiers' `BlockStored` events of
        newly registered blocks carry (their parent's hash and their tokens)."""
        self._starts: dict[str, int] = {}
        """Where each request planned by `get_computed_blocks` starts computing."""
        self._cached_until: dict[str, int] = {}
        """Requests replaying part of their hit: the hit's end (full-layer K/V not rewritten)."""

    @property
    def hash_seed(self) -> bytes:
        """The seed of every block hash (from the model fingerprint)."""
        return self._seed

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one request can ever hold (the whole pool)."""
        return self.pool.num_usable_blocks * self.block_size

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.pool.num_usable_blocks - self.pool.num_free_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (some still hold cached content)."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered (in use or free)."""
        return self.pool.num_cached_blocks

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks (kept per request, extended as blocks fill)."""
        rid = request.request_id
        hashes = self._hashes.get(rid, [])
        num_full = request.num_tokens // self.block_size
        if num_full > len(hashes):
            bs = self.block_size
            new = request.token_span(len(hashes) * bs, num_full * bs)
            hashes = extend_block_hashes(hashes, new, bs, self._seed, request.cache_salt)
        self._hashes[rid] = hashes
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix in full blocks, and where computing starts: its length in
        tokens (a multiple of the block size, at most `num_tokens - 1`), or with a window group
        possibly before it (a stored window or a bounded replay). Nothing for a request that
        needs its prompt logits (every position is computed). The blocks are not referenced until
        `allocate_slots` takes them, which must follow before any other allocation."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self._blocks or request.needs_prompt_logits:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        hashes = self.block_hashes(request)
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        start = len(hits) * self.block_size
        if self.window is not None and hits:
            start, _ = self.window.plan_hit(rid, hashes, len(hits))
        self._starts[rid] = start
        return hits, start

    def _num_blocks_short(
        self, request: Request, num_new_tokens: int, hit_blocks: Sequence[Block]
    ) -> tuple[int, int]:
        """(blocks to allocate, free blocks they may come from) for this allocation."""
        held = self._blocks.get(request.request_id) or []
        assert not (held and hit_blocks), "prefix hits are only taken on admission"
        if hit_blocks:
            start = self._starts.get(request.request_id, len(hit_blocks) * self.block_size)
            num_tokens = max(start + num_new_tokens, len(hit_blocks) * self.block_size)
        else:
            num_tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(held) - len(hit_blocks)
        # Touching a free cached hit takes it out of the free queue: it no longer counts as free.
        free = self.pool.num_free_blocks - sum(1 for b in hit_blocks if b.ref_count == 0)
        return max(needed, 0), free

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: Sequence[Block] = (),
        reserve_blocks: int = 0,
    ) -> bool:
        """Whether `allocate_slots` would succeed and still leave `reserve_blocks` free."""
        needed, free = self._num_blocks_short(request, num_new_tokens, hit_blocks)
        return needed + reserve_blocks <= free

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit_blocks: Sequence[Block] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (counting
        `hit_blocks`, the prefix hits from `get_computed_blocks`, as computed). All or nothing:
        on False nothing changed."""
        rid = request.request_id
        table = self._blocks.get(rid)
        if (  # a running request within its blocks (a decode, 15 steps of 16): nothing to do
            table is not None
            and not hit_blocks
            and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
            and rid not in self._starts
        ):
            return True
        needed, free = self._num_blocks_short(request, num_new_tokens, hit_blocks)
        if needed > free:
            return False
        hit_end = len(hit_blocks) * self.block_size
        planned = self._starts.pop(rid, None)
        start = hit_end if planned is None else min(planned, hit_end)
        if rid not in self._blocks:
            if self.enable_prefix_caching:
                self.num_query_tokens += request.num_tokens
                self.num_hit_tokens += start
            self._admit_window(rid, start, hit_end)
        table = self._blocks.table(rid)
        if hit_blocks:
            self.pool.touch(hit_blocks)
            table.extend(hit_blocks)
            self._num_registered[rid] = len(hit_blocks)
        table.extend(self.pool.allocate(needed))
        return True

    def _admit_window(self, rid: str, start: int, hit_end: int) -> None:
        """Take the window hit planned for a request computing from `start` (of a `hit_end`
        prefix hit): its stored window, or a replay whose full-layer K/V stays as cached."""
        if self.window is None:
            return
        if start < hit_end:
            self._cached_until[rid] = hit_end
        self.window.take(rid, start)

    def chunk_tables(self, request: Request, end: int) -> ChunkTables:
        """The tables of a chunk computing the request's positions from `num_computed_tokens`
        to `end`; with a window group, first allocating the windowed blocks it writes (never
        waits: the pool is sized for every request's window and the steps in flight)."""
        rid = request.request_id
        if self.window is None:
            return ChunkTables(self.block_ids(rid), (), 0)
        self.window.allocate(rid, request.num_computed_tokens, end)
        cached_until = self._cached_until.get(rid, 0)
        if cached_until <= request.num_computed_tokens:
            cached_until = 0
        return ChunkTables(self.block_ids(rid), self.window.block_ids(rid), cached_until)

    def claim_prompt_blocks(self, request: Request) -> None:
        """On admission: claim the request's full prompt blocks past its computed prefix that
        nobody else computes or has cached, until `cache_blocks` registers them or `free`."""
        if not self.enable_prefix_caching:
            return
        first = request.num_computed_tokens // self.block_size
        hashes = self.block_hashes(request)[first:]
        self._claims.claim(request.request_id, hashes, self._is_cached)

    def _is_cached(self, block_hash: BlockHash) -> bool:
        return self.pool.get_cached_block(block_hash) is not None

    def computing_elsewhere(self, request: Request, num_hit: int) -> bool:
        """Whether the block after a `num_hit`-token prefix hit, one a hit could cover, is being
        computed for another request right now (then wait for it and hit it instead)."""
        index = num_hit // self.block_size
        if not self._claims or index >= (request.num_tokens - 1) // self.block_size:
            return False
        if request.needs_prompt_logits:  # it would not hit them
            return False
        owner = self._claims.owner(self.block_hashes(request)[index])
        return owner is not None and owner != request.request_id

    def cache_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are full and fully computed
        (call after the step that advanced `num_computed_tokens` has run); with a window group,
        also those of its windowed blocks, then free the ones that left its window."""
        if self.window is not None:
            self._cache_window(request)
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= start:  # most decode steps: no block filled
            return
        table = self._blocks[rid]
        num_full = min(num_full, len(table))
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        runs: list[int] | None = [] if self.events is not None else None
        for i in range(start, num_full):
            registered = self.pool.cache_block(table[i], hashes[i])
            if registered and self.track_new_blocks:
                self._new_blocks.append((table[i].block_id, hashes[i], request.retention))
            if registered and runs is not None:
                runs.append(i)
        if runs:
            self.publish_stored(request.token_span, hashes, runs)
        self._num_registered[rid] = num_full
        if self._claims.holds(rid):
            self._claims.release(rid, set(hashes[start:num_full]))

    def _cache_window(self, request: Request) -> None:
        """The windowed blocks' share of `cache_blocks`: hash, keep the window before the
        prompt's end for the lower tiers (when attached), slide."""
        assert self.window is not None
        hashes = self.block_hashes(request) if self.enable_prefix_caching else []
        track = self.track_new_blocks and self.enable_prefix_caching
        prompt_end = request.num_prompt_tokens // self.block_size * self.block_size
        rid = request.request_id
        self.window.register_and_slide(
            rid, hashes, request.num_computed_tokens, prompt_end if track else None
        )
        if track:
            boundaries = self.window.drain_boundaries()
            self._new_windows.extend((window, request.retention) for window in boundaries)

    def publish_stored(
        self,
        tokens: Callable[[int, int], Sequence[int]],
        hashes: Sequence[BlockHash],
        indices: Sequence[int],
    ) -> None:
        """`BlockStored` for the blocks `indices` (ascending) of a sequence with block hashes
        `hashes`, one event per run of consecutive blocks; `tokens(start, end)` gives the
        sequence's tokens. With a lower tier attached, each block's origin is kept for the
        tiers' own events (`drain_new_origins`)."""
        assert self.events is not None
        bs = self.block_size
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[run_start], indices[k - 1] + 1
            parent = hashes[first - 1] if first > 0 else None
            token_ids = tokens(first * bs, last * bs)
            self.events.stored(hashes[first:last], parent, token_ids)
            if self.track_new_blocks:
                for i in range(first, last):
                    self._new_origins[hashes[i]] = BlockOrigin(
                        hashes[i - 1] if i > 0 else None,
                        tuple(token_ids[(i - first) * bs : (i - first + 1) * bs]),
                    )
            run_start = k

    def drain_new_origins(self) -> dict[BlockHash, BlockOrigin]:
        """Origins of the blocks registered since the last drain (empty with events off)."""
        new, self._new_origins = self._new_origins, {}
        return new

    def drain_new_windows(self) -> list[tuple[list[tuple[int, BlockHash]], str | None]]:
        """Windows before prompts' ends kept since the last drain, for the disk tier: each its
        windowed blocks' (block id, hash) and the request's retention class. Pin them
        (`window.pin`) before the next step."""
        new, self._new_windows = self._new_windows, []
        return new

    def drain_new_blocks(self) -> list[tuple[int, BlockHash, str | None]]:
        """(block id, hash, retention class) of blocks registered since the last drain, for the lower
        tiers' write-behind. Read their KV before the next step: a freed block may be reused."""
        new, self._new_blocks = self._new_blocks, []
        return new

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (finish, abort, preemption). Idempotent."""
        rid = request.request_id
        table = self._blocks.pop(rid)
        if table is not None:
            self.pool.free(table)
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._claims.release(rid)
        self._starts.pop(rid, None)
        self._cached_until.pop(rid, None)
        if self.window is not None:
            self.window.free(rid)

    def reset_prefix_cache(self) -> int:
        """Forget every free block's cached content (in-use blocks keep theirs). Returns how many
        blocks were dropped."""
        dropped = self.pool.reset_prefix_cache()
        if self.window is not None:
            dropped += self.window.pool.reset_prefix_cache()
        return dropped

    def block_ids(self, request_id: str) -> BlockIds:
        return self._blocks.ids(request_id)

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id) or ())

    def usage(self) -> CacheUsage:
        pool = self.pool
        return CacheUsage(
            num_total_blocks=pool.num_usable_blocks,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_query_tokens=self.num_query_tokens,
            num_hit_tokens=self.num_hit_tokens,
            num_window_blocks=0 if self.window is None else self.window.pool.num_usable_blocks,
            num_window_used_blocks=self._num_window_used(),
        )

    def _num_window_used(self) -> int:
        if self.window is None:
            return 0
        pool = self.window.pool
        return pool.num_usable_blocks - pool.num_free_blocks

    def check_window(self, request: Request) -> None:
        """A running request holds no windowed block its next query cannot read."""
        if self.window is not None:
            self.window.check_window(request.request_id, request.num_computed_tokens)

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it,
        no table holds a block twice, and registered blocks carry their request's hash."""
        self.pool.check_integrity()
        self._blocks.check_integrity()
        holders = [0] * self.pool.num_blocks
        self.held.count(holders)
        for rid, table in self._blocks.items():
            require(len({id(b) for b in table}) == len(table), f"{rid} holds a block twice")
            for block in table:
                holders[block.block_id] += 1
            hashes = self._hashes.get(rid, [])
            for i in range(self._num_registered.get(rid, 0)):
                h = table[i].block_hash
                require(h is None or h == hashes[i], f"{rid} block {i} has a foreign hash")
        for block in self.pool.blocks:
            require(
                block.ref_count == holders[block.block_id],
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{holders[block.block_id]} holders",
            )
        require(
            set(self._num_registered) <= self._blocks.request_ids(),
            "registration state of a freed request",
        )
        self._claims.check_integrity(self._blocks.request_ids())
        if self.window is not None:
            self.window.check_integrity()
            require(
                self.window.request_ids() <= self._blocks.request_ids(),
                "a window of a freed request",
            )
        require(
            set(self._cached_until) <= self._blocks.request_ids(), "replay state of a freed request"
        )
