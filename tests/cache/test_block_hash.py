"""Adversarial tests of the chained block hash: the documented byte layout, isolation, stability."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

from deepinfer.cache.block_hash import (
    block_hashes_for,
    extend_block_hashes,
    hash_block,
    root_hash,
    salt_extra,
    seed_bytes,
)

SEED = seed_bytes("3f2a9c")


def spec_hashes(tokens: list[int], block_size: int, seed: bytes, salt: str | None) -> list[bytes]:
    """The layout from the module docstring, written out independently with hashlib."""
    parent = hashlib.sha256(b"deepinfer/kv-root/v1\x00" + struct.pack("<I", len(seed)) + seed)
    prev = parent.digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        extra = b"" if (i > 0 or salt is None) else b"salt\x00" + salt.encode()
        data = b"deepinfer/kv-block/v1\x00" + prev + struct.pack("<I", len(extra)) + extra
        data += struct.pack("<I", len(block)) + b"".join(struct.pack("<I", t) for t in block)
        prev = hashlib.sha256(data).digest()
        out.append(prev)
    return out


def test_matches_documented_layout() -> None:
    rng = random.Random(0)
    for salt in (None, "", "tenant-a"):
        tokens = [rng.randrange(49152) for _ in range(53)]
        got = block_hashes_for(tokens, 16, SEED, salt)
        assert got == spec_hashes(tokens, 16, SEED, salt)
        assert len(got) == 3 and all(len(h) == 32 for h in got)


def test_incremental_equals_one_shot() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(100)]
    full = block_hashes_for(tokens, 8, SEED, "s")
    hashes: list[bytes] = []
    for n in range(0, 101, 3):
        hashes = block_hashes_for(tokens[:n], 8, SEED, "s", hashes)
        assert hashes == full[: n // 8]
    assert block_hashes_for(tokens, 8, SEED, "s", hashes) == full


def test_extending_with_the_new_tokens_alone_equals_the_documented_layout() -> None:
    """A request whose blocks fill hashes only its new tokens (the spans a decode reads)."""
    rng = random.Random(2)
    for salt in (None, "t"):
        tokens = [rng.randrange(49152) for _ in range(90)]
        want = spec_hashes(tokens, 8, SEED, salt)
        hashes: list[bytes] = []
        done = 0
        for n in (0, 5, 8, 30, 31, 64, 90):
            hashes = extend_block_hashes(hashes, tokens[done * 8 : n], 8, SEED, salt)
            done = len(hashes)
            assert hashes == want[: n // 8]


def test_naive_concatenation_collisions_differ() -> None:
    pairs = [([1, 23], [12, 3]), ([0, 1], [1, 0]), ([256, 0], [1, 1]), ([0], [0, 0])]
    for a, b in pairs:
        assert hash_block(None, a, SEED) != hash_block(None, b, SEED)


def test_order_and_parent_matter() -> None:
    a, b = [5, 6, 7, 8], [9, 10, 11, 12]
    h_ab = block_hashes_for(a + b, 4, SEED)
    h_ba = block_hashes_for(b + a, 4, SEED)
    assert h_ab[1] != block_hashes_for(b, 4, SEED)[0]  # same tokens, different parent
    assert set(h_ab).isdisjoint(h_ba)


def test_seeds_and_salts_share_nothing() -> None:
    rng = random.Random(2)
    tokens = [rng.randrange(100) for _ in range(64)]
    variants = [
        block_hashes_for(tokens, 4, seed, salt)
        for seed in (seed_bytes("aa"), seed_bytes("ab"), seed_bytes(""))
        for salt in (None, "", "x", "y", "salt\x00x")
    ]
    all_hashes = [h for v in variants for h in v]
    assert len(set(all_hashes)) == len(all_hashes)


def test_salt_cannot_be_forged_with_tokens_or_seed() -> None:
    # A salt is length-prefixed extra bytes, distinct from token bytes and from the seed.
    salted = hash_block(None, [1, 2], SEED, salt_extra("\x01"))
    assert salted != hash_block(None, [1, 1, 2], SEED)
    assert salted != hash_block(None, [1, 2], SEED + b"\x01")
    assert root_hash(b"ab") != root_hash(b"a") != root_hash(b"")


def test_stable_across_processes() -> None:
    code = (
        "from deepinfer.cache.block_hash import block_hashes_for, seed_bytes;"
        "print(block_hashes_for(list(range(40)), 8, seed_bytes('fp'), 's')[-1].hex())"
    )
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = block_hashes_for(list(range(40)), 8, seed_bytes("fp"), "s")[-1].hex()
    assert out.stdout.strip() == expected
    assert expected == spec_hashes(list(range(40)), 8, b"fp", "s")[-1].hex()
