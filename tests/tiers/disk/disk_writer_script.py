"""A writer process for the disk-tier crash and restart tests (run as a script, not collected).

    python disk_writer_script.py CACHE_DIR MODE N
    MODE "forever": write blocks N, N+1, ... endlessly (touching and sweeping as it goes) until
                    killed; prints "ready" once the first batch is durable.
    MODE "once":    write blocks 0..N-1, flush, close, print "done".
    MODE "read":    open (read-only if another process writes), load blocks 0..N-1, print
                    "hits=<count> ok=<count matching payload_for>" and the stats' readonly flag.

Payloads are a deterministic function of the block index, so a reader can tell a correct block
from a corrupt or misplaced one.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from deepinfer.tiers.disk import DiskTier, DiskTierConfig

FINGERPRINT = "crash-test-model"


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload_for(i: int) -> bytes:
    """1-12 KiB of bytes that depend on i."""
    n = 1024 * (1 + i % 12)
    seed = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (seed * (n // 32 + 1))[:n]


def crash_config(cache_dir: Path) -> DiskTierConfig:
    """Small segments and budget, so rotation, eviction and reclaim all happen under the kill."""
    return DiskTierConfig(
        cache_dir=cache_dir,
        max_bytes=1 << 20,
        segment_bytes=128 << 10,
        max_batch_blocks=8,
        sweep_interval_s=0.05,
    )


def main() -> None:
    cache_dir, mode, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    tier = DiskTier(FINGERPRINT, crash_config(cache_dir))
    tier.open()
    if mode == "read":
        got = tier.load([block_hash(i) for i in range(n)])
        ok = sum(p == payload_for(i) for i, p in enumerate(got))
        hits = sum(p is not None for p in got)
        print(f"hits={hits} ok={ok} readonly={tier.stats().readonly}", flush=True)
        tier.close()
        return
    i, limit = (0, n) if mode == "once" else (n, 1 << 62)
    first = i
    while i < limit:
        while not tier.offer(block_hash(i), payload_for(i), 16, "agent" if i % 2 else "chat"):
            tier.flush()
        if i % 50 == 0:
            tier.touch([block_hash(i // 2)])
        if i == first + 20 and mode == "forever":
            tier.flush()
            print("ready", flush=True)
        i += 1
    tier.flush()
    tier.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
