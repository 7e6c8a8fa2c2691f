"""BlockPool: a fixed set of KV blocks with reference counts and a free queue.

Freed blocks that still hold a cached full prefix stay reusable until a new allocation evicts
them, least recently freed first; blocks with nothing cached are handed out before any of those.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from slipstream.kv_cache.hashing import BlockHash


class BlockPool:
    """Integers only: block ids 0..num_blocks-1, a ref count and an optional hash per block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks; head = next handed out. OrderedDict gives O(1) removal from the middle
        # when a prefix hit revives a freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block that holds it
        # Called with (block, hash) before a cached block's contents are evicted for reuse
        # (the host KV tier copies them out: kv_cache/host_tier.py).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_queue(self) -> list[int]:
        """Free block ids in hand-out order (for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, num: int) -> list[int]:
        """Take `num` free blocks (ref count 1), evicting cached contents as needed."""
        if num > len(self._free):
            raise ValueError(f"cannot allocate {num} blocks: only {len(self._free)} free")
        ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            if self.on_evict is not None and self.block_hash[block_id] is not None:
                self.on_evict(block_id, self.block_hash[block_id])
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit); revive freed ones."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        A block whose count reaches zero joins the free queue: at the tail (most recently
        freed, evicted last) if it holds a cached prefix, at the head if it holds nothing.
        """
        for block_id in block_ids:
            cnt = self.ref_cnt[block_id]
            if cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_cnt[block_id] = cnt - 1
            if cnt == 1:
                self._free[block_id] = None
                if self.block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block under its hash; False if caching is off or the hash is taken."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        if self.block_hash[block_id] is not None:
            raise RuntimeError(f"KV block {block_id} is already cached")
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget the block's hash (its contents are not, or no longer, valid)."""
        self._evict(block_id)
        if self.ref_cnt[block_id] == 0 and block_id in self._free:
            # Nothing worth keeping: hand it out before blocks that still hold prefixes.
            self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents but are no longer shared."""
        for block_id in self._cached.values():
            self.block_hash[block_id] = None
        self._cached.clear()

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
