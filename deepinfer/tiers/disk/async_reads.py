"""The disk tier's reads for an event loop: `load_records`, `DiskStore.load` without blocking it.

The same three steps as the synchronous `load`, so the same crash-safety and verification: the
index lookup (`DiskStore.locate`, an LMDB transaction that may drop undecodable entries) and the
verification (`DiskStore.verify`: lengths, header and checksum of every record, dropping what
fails) run on the loop's default executor through aiofiles; the segment reads in between go
through aiofiles' async files. Each segment file is opened once, and records that lie back to
back in it (a prompt's blocks are appended together) are fetched by one read of at most
`MAX_RUN_BYTES`. A location past the file's end is not read (a miss, like a missing file); a
short read leaves a short record, which fails verification.

No asyncio here (the cache layer stays free of it): aiofiles hands the calls to the running loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import aiofiles
import aiofiles.os

from deepinfer.cache.block_hash import BlockHash
from deepinfer.tiers.disk.records import BlockRecord
from deepinfer.tiers.disk.segments import HEADER, RawRecord, SegmentStore, record_fits
from deepinfer.tiers.disk.store import DiskStore, LoadResult

MAX_RUN_BYTES = 8 << 20
"""The most bytes one read fetches (a run of adjacent records; a larger record is read alone)."""

P = ParamSpec("P")
R = TypeVar("R")
Item = tuple[int, BlockRecord]
"""(position in the request, index record)."""


async def load_records(store: DiskStore, hashes: Sequence[BlockHash]) -> LoadResult:
    """`store.load(hashes)`, awaited: same results, same entries dropped."""
    records = await run_blocking(store.locate, hashes)
    raws = await read_records(store.segments, records)
    return await run_blocking(store.verify, hashes, records, raws)


async def run_blocking(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn(*args, **kwargs)` on the running loop's default executor."""
    result: R = await aiofiles.os.wrap(fn)(*args, **kwargs)
    return result


async def read_records(
    segments: SegmentStore, records: Sequence[BlockRecord | None]
) -> list[RawRecord | None]:
    """Each record as read, unverified (None: no record, no file, or past the file's end)."""
    raws: list[RawRecord | None] = [None] * len(records)
    by_segment: dict[int, list[Item]] = {}
    for i, record in enumerate(records):
        if record is not None:
            by_segment.setdefault(record.segment, []).append((i, record))
    for segment, items in by_segment.items():
        await _read_segment(segments.path(segment), items, raws)
    return raws


async def _read_segment(path: Path, items: list[Item], raws: list[RawRecord | None]) -> None:
    try:
        async with aiofiles.open(path, "rb") as f:
            file_bytes = await f.seek(0, os.SEEK_END)
            fitting = [(i, r) for i, r in items if record_fits(r.offset, r.length, file_bytes)]
            for run in _runs(fitting):
                start = run[0][1].offset
                await f.seek(start)
                data: bytes = await f.read(_end(run[-1][1]) - start)
                for i, r in run:
                    at = r.offset - start
                    raws[i] = data[at : at + HEADER.size], data[at + HEADER.size : _end(r) - start]
    except FileNotFoundError:
        return  # the segment was reclaimed (or lost): its records are misses


def _runs(items: list[Item]) -> list[list[Item]]:
    """`items` by offset, grouped into runs of records that each start where the last ended."""
    runs: list[list[Item]] = []
    for item in sorted(items, key=lambda it: it[1].offset):
        record, run = item[1], runs[-1] if runs else None
        adjacent = run is not None and record.offset == _end(run[-1][1])
        if run is not None and adjacent and _end(record) - run[0][1].offset <= MAX_RUN_BYTES:
            run.append(item)
        else:
            runs.append([item])
    return runs


def _end(record: BlockRecord) -> int:
    """Where the record ends in its segment (header included)."""
    return record.offset + HEADER.size + record.length
