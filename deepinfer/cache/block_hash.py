"""Chained block hashes: the identity of a full KV block, stable across processes and restarts.

A block's hash covers its parent's hash, so it names the whole prefix up to and including the
block. Hashes are keys in the device pool's cache map and, later, in the disk tier's LMDB index.

Byte layout (version 1; any change must bump the tags, since persisted keys depend on it):

    root(seed)         = sha256(ROOT_TAG  || u32le(len(seed))  || seed)
    hash(parent, toks) = sha256(BLOCK_TAG || parent (32 bytes) || u32le(len(extra)) || extra
                                || u32le(len(toks)) || u32le(t) for t in toks)

`seed` is the model fingerprint (see `seed_bytes`): blocks of different models never match. The
first block's parent is `root(seed)`; its `extra` carries the cache salt (`salt_extra`), so two
salts share no block at all, and later blocks inherit the difference through the chain. Every
variable-length field is length-prefixed and tokens have a fixed width, so no two distinct inputs
serialise to the same bytes ([1, 23] and [12, 3] differ, as do a salt and a token prefix).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""32 bytes (sha256 digest)."""

HASH_NUM_BYTES = 32
ROOT_TAG = b"deepinfer/kv-root/v1\x00"
BLOCK_TAG = b"deepinfer/kv-block/v1\x00"
SALT_TAG = b"salt\x00"
WINDOW_TAG = b"deepinfer/kv-window/v1\x00"
_U32 = struct.Struct("<I")


def seed_bytes(fingerprint: str) -> bytes:
    """The hash seed for a model fingerprint string (its UTF-8 bytes, taken verbatim)."""
    return fingerprint.encode("utf-8")


def salt_extra(salt: str | None) -> bytes:
    """The `extra` bytes mixed into a request's first block: empty without a salt.

    `""` is a salt like any other (it differs from None): callers wanting "no salt" pass None.
    """
    return b"" if salt is None else SALT_TAG + salt.encode("utf-8")


def window_key(block_hash: BlockHash) -> BlockHash:
    """The key under which the lower tiers keep a block's sliding-window layers' KV (its own
    hash keys the full layers'): sha256(WINDOW_TAG || hash)."""
    assert len(block_hash) == HASH_NUM_BYTES, "a block hash is 32 bytes"
    return hashlib.sha256(WINDOW_TAG + block_hash).digest()


def root_hash(seed: bytes) -> BlockHash:
    """The parent of every first block for this seed."""
    return hashlib.sha256(ROOT_TAG + _U32.pack(len(seed)) + seed).digest()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], seed: bytes, extra: bytes = b""
) -> BlockHash:
    """Hash one block of tokens chained to `parent` (None: the first block, chained to the root).

    `seed` is used only through the root (a non-first block inherits it from its parent).
    Token ids must fit in an unsigned 32-bit integer.
    """
    if parent is None:
        parent = root_hash(seed)
    assert len(parent) == HASH_NUM_BYTES, "parent must be a 32-byte block hash"
    h = hashlib.sha256(BLOCK_TAG)
    h.update(parent)
    h.update(_U32.pack(len(extra)))
    h.update(extra)
    h.update(_U32.pack(len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def block_hashes_for(
    token_ids: Sequence[int],
    block_size: int,
    seed: bytes,
    salt: str | None = None,
    start_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending `start_hashes` (the hashes already
    known for the leading blocks of the same token sequence, same seed and salt).

    A request keeps its list and calls this again as blocks fill: the cost is proportional to the
    new full blocks only. A trailing partial block is never hashed.
    """
    skip = len(start_hashes) * block_size
    return extend_block_hashes(start_hashes, token_ids[skip:], block_size, seed, salt)


def extend_block_hashes(
    hashes: Sequence[BlockHash],
    new_token_ids: Sequence[int],
    block_size: int,
    seed: bytes,
    salt: str | None = None,
) -> list[BlockHash]:
    """`hashes` (of a sequence's first full blocks) then those of the full blocks of
    `new_token_ids`, the tokens that follow them: a request whose blocks fill reads only its new
    tokens, never its whole context again."""
    out = list(hashes)
    parent = out[-1] if out else None
    for start in range(0, len(new_token_ids) - block_size + 1, block_size):
        extra = salt_extra(salt) if not out else b""
        parent = hash_block(parent, new_token_ids[start : start + block_size], seed, extra)
        out.append(parent)
    return out
