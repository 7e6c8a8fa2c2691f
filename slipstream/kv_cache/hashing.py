"""Chained block hashes for prefix caching.

A full block's hash covers its own token ids, the hash of the block before it (so equal hashes
mean equal whole prefixes) and, for the first block, an optional cache salt that isolates tenants.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# Parent of a sequence's first block; never the digest of real content in practice.
ROOT_HASH: BlockHash = bytes(32)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None
) -> BlockHash:
    """sha256(parent || len || token ids as int64 || extra key): fixed-width fields, unambiguous.

    A cryptographic hash because a collision would silently serve another prompt's K/V.
    """
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(extra_key.encode("utf-8"))
    return h.digest()


def hash_request_tokens(
    token_ids: Sequence[int], block_size: int, extra_key: str | None = None
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, in order (a partly filled block can change)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        block = token_ids[start : start + block_size]
        hashes.append(hash_block_tokens(parent, block, None if hashes else extra_key))
    return hashes
