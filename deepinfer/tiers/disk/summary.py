"""`summarize(index)`: what the disk tier holds per retention class, read from its LMDB index.

One read transaction over every `blocks` entry (O(entries): about a microsecond each), so the
caller runs it in a worker thread and not on every request; damaged entries are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.tiers.disk.index import BlockIndex
from deepinfer.tiers.disk.records import try_decode_record
from deepinfer.tiers.disk.segments import record_bytes
from deepinfer.tiers.stats import ClassSummary, DiskSummary


@dataclass
class _Tally:
    blocks: int = 0
    tokens: int = 0
    bytes: int = 0
    first: float | None = None
    last: float | None = None

    def add(self, num_tokens: int, num_bytes: int, expires_s: float) -> None:
        self.blocks += 1
        self.tokens += num_tokens
        self.bytes += num_bytes
        self.first = expires_s if self.first is None else min(self.first, expires_s)
        self.last = expires_s if self.last is None else max(self.last, expires_s)


def summarize(
    index: BlockIndex, retention_s: tuple[tuple[str, float], ...], max_bytes: int
) -> DiskSummary:
    """Blocks, tokens, bytes and expiry range per retention class (`retention_s`: the
    configured classes and their lifetimes)."""
    tallies: dict[str, _Tally] = {name: _Tally() for name, _ in retention_s}
    with index.begin(db=index.blocks) as txn:
        for key, value in txn.cursor().iternext():
            record = try_decode_record(key, value)
            if record is not None:
                tally = tallies.setdefault(record.retention, _Tally())
                tally.add(record.num_tokens, record_bytes(record.length), record.expires_s)
    lifetimes = dict(retention_s)
    classes = tuple(
        ClassSummary(name, lifetimes.get(name, 0.0), t.blocks, t.tokens, t.bytes, t.first, t.last)
        for name, t in tallies.items()
    )
    return DiskSummary(classes, len(index.segments()), max_bytes)
