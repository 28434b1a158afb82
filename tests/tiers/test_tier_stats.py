"""`tiers/stats.py` is a leaf: the API names the tiers' records without loading the tiers (no
lmdb, torch, aiofiles or msgspec, no cache modules)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "lmdb", "aiofiles", "msgspec", "deepinfer.cache", "deepinfer.tiers.disk")


def test_importing_the_records_loads_nothing_heavy() -> None:
    code = (
        "import sys, deepinfer.tiers.stats\n"
        f"print('\\n'.join(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == []
