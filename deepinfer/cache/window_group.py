"""The sliding-window layers' blocks: a pool of their own, holding only each request's window.

A model whose layers mostly attend a window of W keys (Gemma 3: 15 of 18 layers, W = 512) keeps
two KV groups. The full layers' blocks live in the manager's main pool, every block of every
request, hashed and shared as always. The windowed layers' blocks live here: a request's table
has one entry per logical block like the main table, but only the blocks its next query can
still read hold a block (`None` elsewhere, block 0 to the kernels, which never read keys before
a window). As the request advances, the blocks that fell out of its window are freed to this
pool's LRU with their hashes, so the last windows of finished requests stay cached.

Prefix hits and bounded replay
------------------------------
A hit of P tokens in the full group gives every full layer its keys. The windowed layers need
the K/V of positions P - W + 1 .. P - 1, exact. Two ways to get them:

- Stored: this pool still holds the windowed blocks covering [X - W + 1, X) for some block
  boundary X <= P (where an agent turn ended, or any block of a recent request's window). The
  request then computes from X, exactly; the full layers read their cached K/V for [X, P) and
  do not rewrite it.
- Replayed: with no stored window, compute from R = P - n_w (W - 1), n_w the number of
  windowed layers (rounded down so that the block holding P - W + 1 is exact throughout, then
  to a block). Why that is exact for every position >= P - W + 1: the
  hidden state entering a layer is exact at position p once every key that reached p was exact.
  Embeddings are exact from R. A full layer reads cached (exact) keys for every position before
  P and computes its new ones from exact inputs, so it keeps the exact front where it is. A
  windowed layer's output at p reads its keys from p - W + 1, so each one moves the front by
  W - 1. The j-th windowed layer's K/V is therefore exact from R + (j - 1)(W - 1), and the last
  one's from R + (n_w - 1)(W - 1) <= P - W + 1: the keys the first new query reads. The
  replayed positions before that front attend keys that may be missing (block 0) or inexact;
  by the same argument that never reaches an exact position, and those blocks are never hashed.

Gemma 3 270M: 15 x 511 = 7,665 tokens (7,680 rounded to blocks of 16) replayed at most.

Where a request's prompt ends (its last full block boundary: where an agent's next turn
resumes), the window before it is also handed to the disk tier (`drain_boundaries`), keyed by
`window_key` of each block's hash, and filled back into this pool on a later hit
(`reserve`/`commit`) after the device copy is long gone.

Capacity: a request holds at most ceil((W - 1) / S) + 2 blocks between steps, plus the blocks of
its chunk during one; `window_pool_blocks` sizes the pool for the worst case, so allocating
here never waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.block_ids import BlockIds
from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer.cache.free_queue import Block, require


@dataclass(frozen=True)
class WindowSpec:
    """The windowed layers of a model, as the cache sees them."""

    window: int
    """W: keys a windowed query attends, its own included."""
    num_windowed_layers: int
    """n_w: how far a replay's inexact front travels (W - 1 positions per windowed layer)."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.num_windowed_layers < 1:
            raise ValueError(
                f"a window of {self.window} keys over {self.num_windowed_layers} layers"
            )

    def replay_start(self, hit_end: int, block_size: int) -> int:
        """Where a replay of a `hit_end`-token prefix starts: R, rounded down so that the whole
        first block the next query reads is exact (its blocks can then be hashed), and to a
        block."""
        first_read = self.first_block_needed(hit_end, block_size) * block_size
        start = max(0, first_read - (self.num_windowed_layers - 1) * (self.window - 1))
        return start // block_size * block_size

    def exact_from(self, start: int, replayed: bool) -> int:
        """The first position whose K/V is exact in every windowed layer, computing from `start`
        (exact state there unless `replayed`)."""
        if not replayed or start == 0:
            return start
        return start + (self.num_windowed_layers - 1) * (self.window - 1)

    def blocks_per_request(self, block_size: int) -> int:
        """Most blocks one request holds during a step, besides its chunk's: ceil((W - 1) / S)
        for the window, the partly filled one, the one its chunk starts in, one more."""
        return -(-(self.window - 1) // block_size) + 3

    def first_block_needed(self, position: int, block_size: int) -> int:
        """The first block the query at `position` reads in a windowed layer."""
        return max(0, position - self.window + 1) // block_size


def window_pool_blocks(
    spec: WindowSpec, block_size: int, max_num_seqs: int, max_step_tokens: int
) -> int:
    """Blocks the windowed pool needs so that no allocation ever waits: each request's window
    (ceil((W - 1) / S) blocks, plus the partly filled one and the one a chunk starts in), plus
    every token of the steps in flight (`max_step_tokens`, both lanes' together) one block
    each at worst, plus one window being filled from the disk tier, plus the null block."""
    per_request = spec.blocks_per_request(block_size)
    return (max_num_seqs + 1) * per_request + -(-max_step_tokens // block_size) + 1


def best_window_end(
    spec: WindowSpec, block_size: int, stored: Sequence[bool], floor: int
) -> int | None:
    """The latest block boundary X >= `floor` whose window [X - W + 1, X) is entirely in
    stored blocks (`stored[i]`: block i is), or None."""
    run, best = 0, None  # run: consecutive stored blocks ending at block i
    for i, here in enumerate(stored):
        run = run + 1 if here else 0
        end = (i + 1) * block_size
        if end >= floor and run >= i + 1 - spec.first_block_needed(end, block_size):
            best = end
    return best


@dataclass
class _Held:
    table: list[Block | None]
    num_registered: int
    """Leading entries already offered to the cache map (or never to be: inexact)."""
    exact_from: int
    """Positions before this were replayed inexactly: their blocks are never hashed."""
    boundary_done: bool = False
    """The window before the prompt's end was offered to the lower tiers (or could not be)."""


class WindowGroup:
    """The windowed layers' pool and tables (see the module docstring)."""

    def __init__(
        self, spec: WindowSpec, num_blocks: int, block_size: int, enable_caching: bool
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self._held: dict[str, _Held] = {}
        self._boundaries: list[list[tuple[int, BlockHash]]] = []
        """Windows before prompts' ends not yet drained: (block id, block hash) each."""
        self._fill: list[Block] | None = None
        """Blocks reserved for the one window being filled from the disk tier."""
        self._pins: dict[int, list[Block]] = {}
        self._next_pin = 0
        self._pending: dict[str, tuple[int, list[Block], bool]] = {}
        """Per request, from `plan_hit` to `take`: the stored window's first block index and
        blocks, and whether the start is a replay's (inexact before its front)."""

    # -- prefix hits --
    def plan_hit(
        self, request_id: str, hashes: Sequence[BlockHash], num_hit_blocks: int
    ) -> tuple[int, bool]:
        """Where a request with `num_hit_blocks` full-group hits starts computing: the latest
        block boundary X <= the hit's end whose window is stored here, else the replay start R.
        Returns (start, replayed). The stored window's blocks are taken by `take`."""
        self._pending.pop(request_id, None)
        bs = self.block_size
        floor = self.spec.replay_start(num_hit_blocks * bs, bs)
        best = self.stored_window_end(hashes, num_hit_blocks)
        if best is None:
            self._pending[request_id] = (0, [], floor > 0)
            return floor, floor > 0
        first_needed = self.spec.first_block_needed(best, bs)
        blocks = [self.pool.get_cached_block(hashes[i]) for i in range(first_needed, best // bs)]
        self._pending[request_id] = (first_needed, [b for b in blocks if b is not None], False)
        return best, False

    def take(self, request_id: str, start: int) -> None:
        """Admit the request computing from `start`: reference its planned window hit."""
        first, blocks, replayed = self._pending.pop(request_id, (0, [], False))
        table: list[Block | None] = [None] * first
        if blocks:
            self.pool.touch(blocks)
            table.extend(blocks)
        exact_from = self.spec.exact_from(start, replayed)
        self._held[request_id] = _Held(table, len(table), exact_from)

    # -- a request's window --
    def allocate(self, request_id: str, start: int, end: int) -> None:
        """Blocks for positions [start, end) (a chunk about to be computed)."""
        held = self._held.setdefault(request_id, _Held([], 0, 0))
        bs, table = self.block_size, held.table
        last = -(-end // bs)
        missing = [i for i in range(start // bs, last) if i >= len(table) or table[i] is None]
        require(
            len(missing) <= self.pool.num_free_blocks,
            f"windowed pool short: {len(missing)} blocks wanted, {self.pool.num_free_blocks} free",
        )
        if len(table) < last:
            table.extend([None] * (last - len(table)))
        for i, block in zip(missing, self.pool.allocate(len(missing)), strict=True):
            table[i] = block

    def register_and_slide(
        self,
        request_id: str,
        hashes: Sequence[BlockHash],
        num_computed: int,
        prompt_end: int | None = None,
    ) -> None:
        """After a step: hash the blocks that are full, computed and exact; once computing
        passed `prompt_end` (a block boundary; None: the lower tiers take no windows), keep the
        window before it for `drain_boundaries`; then free the blocks the next query (at
        `num_computed`) no longer reads, to the LRU with their hashes."""
        held = self._held.get(request_id)
        if held is None:
            return
        bs, table = self.block_size, held.table
        num_full = min(num_computed // bs, len(table))
        if self.pool.enable_caching:
            for i in range(held.num_registered, num_full):
                block = table[i]
                if block is not None and i * bs >= held.exact_from:
                    self.pool.cache_block(block, hashes[i])
        held.num_registered = max(held.num_registered, num_full)
        if prompt_end is not None and not held.boundary_done and num_computed >= prompt_end:
            held.boundary_done = True
            self._keep_boundary(held, prompt_end)
        stale = self.spec.first_block_needed(num_computed, bs)
        dropped = [b for b in table[:stale] if b is not None]
        if dropped:
            table[:stale] = [None] * stale
            self.pool.free(dropped)

    def _keep_boundary(self, held: _Held, end: int) -> None:
        """The window before `end`, if every block of it is held and hashed."""
        if end == 0:
            return
        first = self.spec.first_block_needed(end, self.block_size)
        blocks = held.table[first : end // self.block_size]
        window = [(b.block_id, b.block_hash) for b in blocks if b is not None and b.block_hash]
        if len(window) == end // self.block_size - first:
            self._boundaries.append(window)

    def drain_boundaries(self) -> list[list[tuple[int, BlockHash]]]:
        """Windows kept since the last drain. Pin their blocks (`pin`) before the next step:
        the window slides on and a freed block may be reused."""
        out, self._boundaries = self._boundaries, []
        return out

    def pin(self, block_ids: Sequence[int]) -> int:
        """Hold blocks while a lower tier copies them. Returns the pin for `unpin`."""
        blocks = [self.pool.blocks[i] for i in block_ids]
        self.pool.touch(blocks)
        self._next_pin += 1
        self._pins[self._next_pin] = blocks
        return self._next_pin

    def unpin(self, pin: int) -> None:
        self.pool.free(self._pins.pop(pin))

    # -- filling a window from the disk tier --
    def stored_window_end(self, hashes: Sequence[BlockHash], num_hit_blocks: int) -> int | None:
        """The latest block boundary whose window this pool holds, after the replay start of
        a `num_hit_blocks` hit (None: a hit would replay)."""
        bs = self.block_size
        floor = self.spec.replay_start(num_hit_blocks * bs, bs)
        first = self.spec.first_block_needed(floor, bs)  # no window before it matters
        stored = [i >= first and self.pool.get_cached_block(hashes[i]) is not None
                  for i in range(num_hit_blocks)]  # fmt: skip
        return best_window_end(self.spec, bs, stored, floor)

    def reserve(self, num_blocks: int) -> list[int] | None:
        """Blocks to fill one window from the disk tier (one fill at a time: the pool's sizing
        leaves room for one window beside every request's), or None."""
        if self._fill is not None or num_blocks > self.pool.num_free_blocks:
            return None
        if num_blocks > self.spec.blocks_per_request(self.block_size):
            return None
        self._fill = self.pool.allocate(num_blocks)
        return [b.block_id for b in self._fill]

    def commit(self, hashes: Sequence[BlockHash]) -> None:
        """The reserved blocks are filled (the first `len(hashes)`): register them and free them
        all to the LRU, cached."""
        blocks, self._fill = self._fill or [], None
        for block, block_hash in zip(blocks, hashes, strict=False):
            self.pool.cache_block(block, block_hash)
        self.pool.free(blocks)

    def block_ids(self, request_id: str) -> BlockIds:
        held = self._held.get(request_id)
        if held is None:
            return BlockIds(())
        return BlockIds(NULL_BLOCK_ID if b is None else b.block_id for b in held.table)

    def num_held(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return 0 if held is None else sum(1 for b in held.table if b is not None)

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        held = self._held.pop(request_id, None)
        if held is not None:
            self.pool.free([b for b in held.table if b is not None])

    def request_ids(self) -> set[str]:
        return set(self._held)

    def holders(self) -> dict[str, list[Block]]:
        """Every holder's blocks: requests', pins', the fill's."""
        out = {rid: [b for b in h.table if b is not None] for rid, h in self._held.items()}
        out |= {f"pin {pin}": blocks for pin, blocks in self._pins.items()}
        if self._fill is not None:
            out["fill"] = self._fill
        return out

    def check_integrity(self) -> None:
        """Pool invariants, and each block's ref count equals the number of tables holding it
        (`check_window` checks a request's table against its position)."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for rid, blocks in self.holders().items():
            require(
                len({id(b) for b in blocks}) == len(blocks), f"{rid} holds a window block twice"
            )
            for block in blocks:
                counts[block.block_id] += 1
        for block in self.pool.blocks:
            require(
                block.ref_count == counts[block.block_id],
                f"window block {block.block_id}: ref_count {block.ref_count}, "
                f"{counts[block.block_id]} holders",
            )
        require(not (set(self._pending) & set(self._held)), "a held request has a pending hit")

    def check_window(self, request_id: str, num_computed: int) -> None:
        """The request holds no block before the window of its next query."""
        held = self._held.get(request_id)
        if held is None:
            return
        stale = self.spec.first_block_needed(num_computed, self.block_size)
        require(
            all(b is None for b in held.table[:stale]),
            f"{request_id} holds windowed blocks its next query (at {num_computed}) cannot read",
        )
