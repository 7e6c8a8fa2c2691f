"""HostTier: a second, larger set of KV blocks in host memory, addressed by block hash.

Integers only, like the block pool: which host block holds which hash, least recently used
first. The KV manager offers it each cached GPU block the pool evicts (and, for swap
preemption, a preempted request's blocks); a prefix lookup that misses on the GPU goes on here,
and a hit is copied back into a fresh GPU block. The copies themselves are the runner's
(`ModelRunner.apply_kv_transfers`), queued before the step that needs them.
"""
from __future__ import annotations

from collections import OrderedDict

from slipstream.kv_cache.hashing import BlockHash

# A copy the runner makes before the step's forward: ("out", gpu block, host block) or
# ("in", host block, gpu block), in order.
Transfer = tuple[str, int, int]


class HostTier:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[int] = set()  # read by a copy queued this step: not to be reused

    @property
    def num_stored(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def store(self, block_hash: BlockHash) -> int | None:
        """A host block for `block_hash` to be copied into, or None when it is there already
        (refreshed) or every host block is pinned. Evicts the least recently used."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if self._free:
            host_id = self._free.pop()
        else:
            victim = next((h for h, b in self._by_hash.items() if b not in self._pinned), None)
            if victim is None:
                return None
            host_id = self._by_hash.pop(victim)
        self._by_hash[block_hash] = host_id
        return host_id

    def pin(self, block_hash: BlockHash) -> None:
        self._by_hash.move_to_end(block_hash)
        self._pinned.add(self._by_hash[block_hash])

    def unpin_all(self) -> None:
        self._pinned.clear()

    def reset(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._by_hash.clear()
        self._pinned.clear()

    def check(self) -> None:
        """Every host block is free or holds exactly one hash (tests)."""
        held = list(self._by_hash.values())
        assert len(held) == len(set(held)), "a host block holds two hashes"
        assert not set(held) & set(self._free), "a host block is both free and used"
        assert len(held) + len(self._free) == self.num_blocks, "a host block leaked"
