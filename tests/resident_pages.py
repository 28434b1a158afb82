"""How much of an address range holds memory of its own, read from /proc/self/pagemap: a page
counts when it is present and mapped by this process alone. The shared zero page that reads of
untouched anonymous memory map does not count, and neither does anything else the process (or a
thread an earlier test left running) allocates, unlike the process's RSS."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
AVAILABLE = Path("/proc/self/pagemap").exists()
_PRESENT_AND_EXCLUSIVE = 56  # bit 63: present (the sign bit); bit 56: mapped exclusively


def committed_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """The bytes of the pages in `ranges` (address, length) that hold memory of their own."""
    pages = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for address, length in ranges:
            first, last = address // PAGE, (address + length - 1) // PAGE
            pagemap.seek(first * 8)
            raw = bytearray(pagemap.read((last - first + 1) * 8))
            entries = torch.frombuffer(raw, dtype=torch.int64)
            exclusive = (entries >> _PRESENT_AND_EXCLUSIVE) & 1 == 1
            pages += int(((entries < 0) & exclusive).sum())
    return pages * PAGE


def tensor_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()
