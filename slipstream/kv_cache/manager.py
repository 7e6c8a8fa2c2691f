"""KVCacheManager: per-request block tables over a BlockPool, with prefix caching.

Holds integers only. A request's table grows block by block as it computes tokens; full blocks
are hashed (chained) and registered so later requests with the same prefix can share them.
With a sliding window on every layer, blocks wholly behind the window of the next query are
released as the request advances (their table entries become NULL_BLOCK), so a long request
holds O(window) blocks.
"""
from __future__ import annotations

from slipstream.engine.request import Request
from slipstream.kv_cache.block_pool import BlockPool
from slipstream.kv_cache.hashing import BlockHash, hash_block_tokens

# What a released block's table entry reads: a valid index, never read by attention (each
# layer's kernels start at its window).
NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        """sliding_window: the widest window when every layer has one (models/layer_types.py
        freeable_window); blocks behind it are released. None: tables only grow."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the prefix cache.
        self._num_hashed: dict[str, int] = {}
        # Leading blocks of each table released behind the sliding window (NULL_BLOCK now).
        self._num_released: dict[str, int] = {}
        # Chained hashes of each request's full blocks, grown lazily (kept across retries).
        self._hashes: dict[str, list[BlockHash]] = {}
        # Lookup stats held back until the admission they belong to succeeds, so a request
        # that waits several steps for blocks is counted once.
        self._pending_stats: dict[str, tuple[int, int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached-but-evictable ones included."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: copy it before keeping it)."""
        return self._tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, computed in chunks of
        at most max_chunk tokens: all of them, or with a sliding window the window behind a
        chunk plus the chunk (and a partly covered block at each end)."""
        need = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return need
        return min(need, cdiv(self.sliding_window - 1 + max_chunk, self.block_size) + 1)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (released ones not counted)."""
        return len(self._tables.get(request_id, ())) - self._num_released.get(request_id, 0)

    # ---- prefix cache ------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, number of tokens they hold).

        At least one token is always left to compute so the step has logits to sample from.
        Takes no references: call allocate_slots with the result right away.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._request_hashes(request, max_blocks)
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        num_hit_tokens = len(hit) * self.block_size
        self._pending_stats[request.request_id] = (request.num_tokens, num_hit_tokens)
        return hit, num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights). Always succeeds."""
        self.pool.reset_prefix_cache()
        return True

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow the table to cover num_computed_tokens (+ hits) + num_new_tokens.

        `new_computed_blocks` (from get_computed_blocks) is given on admission only; the caller
        then adds their tokens to request.num_computed_tokens. Returns False and changes nothing
        if the free blocks do not suffice.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and self.sliding_window is not None:
            self._release_behind_window(request, table)
        if table is not None and not new_computed_blocks:
            # Fast path (most decode steps): the table already covers the new tokens.
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(table) * self.block_size:
                self._cache_full_blocks(request, table, total_tokens)
                return True
        hits = new_computed_blocks or []
        if hits and table:
            raise ValueError(f"request {rid!r} already has blocks: prefix hits only on admission")
        total_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_have = len(hits) + (len(table) if table else 0)
        num_needed = max(0, self.num_blocks_for(total_tokens) - num_have)
        # Hit blocks nobody holds sit in the free queue: taking them shrinks it.
        num_revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        if table is None:
            table = self._tables[rid] = []
            self._num_hashed[rid] = 0
        if hits:
            self.pool.touch(hits)  # before allocate, so no hit gets evicted
            table.extend(hits)
            self._num_hashed[rid] = len(hits)
        if num_needed:
            table.extend(self.pool.allocate(num_needed))
        if new_computed_blocks is not None:
            self._commit_stats(rid)
        self._cache_full_blocks(request, table, total_tokens)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (finish, abort or preemption).

        Call before resetting request.num_computed_tokens: blocks past it were registered for
        this step's forward but never written, so their hashes are withdrawn.
        """
        rid = request.request_id
        table = self._tables.pop(rid, None)
        released = self._num_released.pop(rid, 0)
        self._num_hashed.pop(rid, None)
        self._hashes.pop(rid, None)
        self._pending_stats.pop(rid, None)
        if not table:
            return
        first_unwritten = max(request.num_computed_tokens // self.block_size, released)
        for block_id in table[first_unwritten:]:
            if self.pool.ref_cnt[block_id] == 1:
                self.pool.uncache_block(block_id)
        # Tail first: the tail of a chain is useless without its head, so it goes first.
        self.pool.free(reversed(table[released:]))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding's rollback: free the blocks past those holding the first
        `num_tokens` tokens (slots of rejected draft tokens). Such blocks never held only known
        tokens, so none is in the prefix cache; a hash is withdrawn all the same."""
        rid = request.request_id
        table = self._tables.get(rid)
        keep = max(self.num_blocks_for(num_tokens), self._num_released.get(rid, 0))
        if not table or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        self._num_hashed[rid] = min(self._num_hashed[rid], keep)
        for block_id in extra:
            if self.pool.ref_cnt[block_id] == 1:
                self.pool.uncache_block(block_id)
        self.pool.free(reversed(extra))

    # ---- internals ---------------------------------------------------------------------
    def _release_behind_window(self, request: Request, table: list[int]) -> None:
        """Release the blocks no coming query can see: the next query sits at
        num_computed_tokens or later, and sees keys from num_computed_tokens - W + 1 on.
        Launched steps still reading them run before any later step's writes (one stream)."""
        rid = request.request_id
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1)
        keep_from = min(first_needed // self.block_size, len(table))
        done = self._num_released.get(rid, 0)
        if keep_from <= done:
            return
        behind = table[done:keep_from]
        table[done:keep_from] = [NULL_BLOCK] * (keep_from - done)
        self._num_released[rid] = keep_from
        # Tail first, as in free(): a chain's head is worth more to the prefix cache.
        self.pool.free(reversed(behind))

    def _request_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained hashes, grown to cover its first `num_blocks` full blocks."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        start, end = len(hashes), min(num_blocks, request.num_known_tokens // bs)
        if start < end:
            tokens = request.token_ids_slice(start * bs, end * bs)  # only the new blocks
            extra = _extra_key(request)
            for i in range(start, end):
                block = tokens[(i - start) * bs : (i - start + 1) * bs]
                parent = hashes[i - 1] if i else None
                hashes.append(hash_block_tokens(parent, block, None if i else extra))
        return hashes

    def _cache_full_blocks(self, request: Request, table: list[int], total_tokens: int) -> None:
        """Offer newly filled blocks to the prefix cache.

        Their K/V is written by the coming forward before any attention reads it, so a request
        admitted in the same step may already share them.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        # Only blocks whose tokens are all known (multi-step decode reserves slots ahead; an
        # async step's sampled token is a placeholder until read).
        num_full = min(total_tokens, request.num_known_tokens) // self.block_size
        start = max(self._num_hashed[rid], self._num_released.get(rid, 0))
        if num_full <= start:
            return
        hashes = self._request_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])  # a duplicate stays private
        self._num_hashed[rid] = num_full

    def _commit_stats(self, request_id: str) -> None:
        queries, hits = self._pending_stats.pop(request_id, (0, 0))
        self.prefix_cache_queries += queries
        self.prefix_cache_hits += hits


def _extra_key(request: Request) -> str | None:
    """Per-request salt folded into the first block's hash (isolates tenants / adapters)."""
    salt = getattr(request, "cache_salt", None)
    return str(salt) if salt is not None else None
