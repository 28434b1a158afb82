"""Stable identities of weights and of the KV a model writes, for persistent prefix-cache keys.

`file_digest` is sha256 over a version tag, the file size and the file's bytes: all of them for
files up to `FULL_HASH_LIMIT_BYTES` (the 98 MB default model hashes in well under a second);
beyond that the first `HEAD_BYTES` (GGUF/safetensors header, metadata and tensor table), the last
`WINDOW_BYTES`, and `NUM_WINDOWS` windows evenly spaced between. The result depends only on the
file's contents, so it is the same in every process and across restarts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FINGERPRINT_VERSION = 1
FULL_HASH_LIMIT_BYTES = 256 << 20
HEAD_BYTES = 16 << 20
WINDOW_BYTES = 1 << 20
NUM_WINDOWS = 64
_CHUNK_BYTES = 1 << 20


def _ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) pairs of the bytes to hash."""
    if size <= FULL_HASH_LIMIT_BYTES:
        return [(0, size)]
    ranges = [(0, HEAD_BYTES)]
    span = size - HEAD_BYTES - WINDOW_BYTES
    for i in range(NUM_WINDOWS):
        ranges.append((HEAD_BYTES + span * i // NUM_WINDOWS, WINDOW_BYTES))
    ranges.append((size - WINDOW_BYTES, WINDOW_BYTES))
    return ranges


def file_digest(path: Path) -> str:
    """sha256 hex digest identifying a weights file (see the module docstring)."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"deepinfer-file-v{FINGERPRINT_VERSION}:{size}:".encode())
    with path.open("rb") as f:
        for offset, length in _ranges(size):
            f.seek(offset)
            remaining = length
            while remaining > 0:
                chunk = f.read(min(_CHUNK_BYTES, remaining))
                if not chunk:
                    break
                digest.update(chunk)
                remaining -= len(chunk)
    return digest.hexdigest()


def directory_digest(config_path: Path, weight_files: list[Path]) -> str:
    """sha256 over config.json's bytes and each weights file's name and digest, in name order."""
    digest = hashlib.sha256(f"deepinfer-dir-v{FINGERPRINT_VERSION}:".encode())
    digest.update(config_path.read_bytes())
    for path in sorted(weight_files, key=lambda p: p.name):
        digest.update(f"\0{path.name}\0{file_digest(path)}".encode())
    return digest.hexdigest()


def kv_fingerprint(
    weights_digest: str,
    dtype_name: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str:
    """sha256 hex digest of everything that determines the bytes of a KV block."""
    record = {
        "version": FINGERPRINT_VERSION,
        "weights": weights_digest,
        "dtype": dtype_name,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
