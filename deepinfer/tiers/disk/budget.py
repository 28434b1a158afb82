"""`ByteBudget`: the disk tier's byte budget, lowered while its filesystem is full.

`max_bytes` is a ceiling, not a promise. When a write fails for want of space (`is_no_space`:
ENOSPC or EDQUOT from a segment file, ENOSPC from LMDB), `lower` sets the budget below what the tier
holds, by a headroom of an eighth of the space the tier can have (what it holds plus what the
filesystem has free; at least one segment). The writer then makes room at once: whole closed
segments go first, oldest first, each file deleted before its index entries (removing entries
takes an index commit, and that takes free space: `DiskStore.shed`), then the sweep evicts as
usual (expired blocks, then least recently used) within the lowered budget, and the batch is
written again. So caching goes on within the lowered budget, and the headroom is left to the
filesystem's other writers. While lowered, room for each batch is made before it is written, and
each sweep sets the budget again from the space the tier can have (`follow`): it shrinks as other
writers take space and grows as they give it back, up to `max_bytes`, where it stays until the
next failure. The budget never falls below two segments.

Free space is what `statvfs` reports to unprivileged users; quotas are not seen there, so under
a quota the budget is lowered only by the failures themselves.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import lmdb

from deepinfer.cache.free_queue import require

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
HEADROOM_FRACTION = 8
"""The headroom left free is 1/HEADROOM_FRACTION of the space the tier can have."""
NEARLY_FULL_BYTES = 1 << 20
"""Below this much free space an I/O error counts as a full filesystem (see `is_no_space`)."""


def is_no_space(exc: BaseException, directory: Path | None = None) -> bool:
    """Whether `exc` says the filesystem (or the user's quota) is full: ENOSPC or EDQUOT, or, given
    the `directory` written to, an I/O error while its filesystem has less than
    `NEARLY_FULL_BYTES` free (LMDB reports a page write cut short by a full filesystem as EIO)."""
    if isinstance(exc, lmdb.DiskError):  # LMDB's name for ENOSPC
        return True
    code = _errno(exc)
    if code in NO_SPACE_ERRNOS:
        return True
    return code == errno.EIO and directory is not None and free_bytes(directory) < NEARLY_FULL_BYTES


def _errno(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    if isinstance(exc, lmdb.Error) and len(exc.args) > 1 and isinstance(exc.args[1], int):
        return exc.args[1]  # py-lmdb's (what, code)
    return None


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still add to `directory`'s filesystem (0 if unknown)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


class ByteBudget:
    def __init__(self, max_bytes: int, segment_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.min_bytes = 2 * segment_bytes
        """The floor: the smallest budget a configuration may have (`DiskTierConfig`)."""
        self._bytes = max_bytes

    @property
    def bytes(self) -> int:
        """The budget now: `max_bytes`, or less while the filesystem is short of space."""
        return self._bytes

    @property
    def lowered(self) -> bool:
        return self._bytes < self.max_bytes

    def lower(self, held_bytes: int, free: int) -> int:
        """A write failed for want of space while the tier held `held_bytes` and the filesystem
        had `free` bytes: lower the budget below what is held (and below where it was).
        Returns the new budget."""
        target = held_bytes - self._headroom(held_bytes + free)
        self._bytes = self._clamp(min(self._bytes, target))
        return self._bytes

    def follow(self, held_bytes: int, free: int) -> int:
        """While lowered: the budget from the space the tier can have now (raised as space
        returns, up to `max_bytes`; lowered as other writers take it). Returns the budget."""
        if self.lowered:
            space = held_bytes + free
            self._bytes = self._clamp(space - self._headroom(space))
        return self._bytes

    def _headroom(self, space_bytes: int) -> int:
        return max(self.segment_bytes, space_bytes // HEADROOM_FRACTION)

    def _clamp(self, num_bytes: int) -> int:
        return max(self.min_bytes, min(self.max_bytes, num_bytes))

    def check_integrity(self) -> None:
        require(
            self.min_bytes <= self._bytes <= self.max_bytes, f"budget {self._bytes} out of bounds"
        )
