"""`PromptClaims`: prompt blocks being computed right now, and by which request.

On admission a request claims its full prompt blocks that nobody computes or has cached; a
request whose next uncached block another request is computing waits for it and then hits it,
so a shared prefix in flight is computed once. Claims end when the blocks are registered
(`release` with their hashes) or the request's blocks are freed (`release` of all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.free_queue import require


class PromptClaims:
    def __init__(self) -> None:
        self._owner: dict[BlockHash, str] = {}
        """Hashes of prompt blocks being computed -> the request computing them."""
        self._claimed: dict[str, list[BlockHash]] = {}

    def __bool__(self) -> bool:
        return bool(self._owner)

    def claim(
        self, request_id: str, hashes: Iterable[BlockHash], cached: Callable[[BlockHash], bool]
    ) -> None:
        """Claim the `hashes` that nobody claimed and that are not `cached`."""
        claimed = self._claimed.setdefault(request_id, [])
        for block_hash in hashes:
            if block_hash in self._owner or cached(block_hash):
                continue
            self._owner[block_hash] = request_id
            claimed.append(block_hash)

    def owner(self, block_hash: BlockHash) -> str | None:
        return self._owner.get(block_hash)

    def release(self, request_id: str, registered: set[BlockHash] | None = None) -> None:
        """Drop the request's claims: those in `registered`, or all of them."""
        claimed = self._claimed.pop(request_id, None)
        if not claimed:
            return
        kept = []
        for block_hash in claimed:
            if registered is None or block_hash in registered:
                self._owner.pop(block_hash, None)
            else:
                kept.append(block_hash)
        if kept:
            self._claimed[request_id] = kept

    def holds(self, request_id: str) -> bool:
        return request_id in self._claimed

    def check_integrity(self, live: set[str]) -> None:
        """Claims belong to `live` requests, and both tables agree."""
        require(set(self._claimed) <= live, "claims of a freed request")
        owners = {h: rid for rid, hashes in self._claimed.items() for h in hashes}
        require(owners == self._owner, "claim tables disagree")
