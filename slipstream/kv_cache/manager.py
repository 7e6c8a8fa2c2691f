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
from slipstream.kv_cache.host_tier import HostTier, Transfer
from slipstream.kv_cache.tier_cost import TierCost

# What a released block's table entry reads: a valid index, never read by attention (each
# layer's kernels start at its window).
NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None):
        """sliding_window: the widest window when every layer has one (models/layer_types.py
        freeable_window); blocks behind it are released. None: tables only grow."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks and not enable_prefix_caching:
            raise ValueError("the host KV tier holds cached prefixes: it needs prefix caching")
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
        self.prefix_cache_hits = 0  # tokens found (host tier included)
        # The host tier (host_tier.py): evicted cached blocks are copied there, and prefix
        # hits on it copied back; the copies wait in _transfers for the runner.
        self.host = HostTier(num_host_blocks) if num_host_blocks else None
        self._transfers: list[Transfer] = []
        self._host_hits: dict[str, list[tuple[BlockHash, int]]] = {}
        self.host_hits = 0  # tokens found in the host tier
        self.blocks_offloaded = 0
        self.host_blocks_recomputed = 0  # host hits left to recompute: cheaper than a copy
        # Copy or recompute (tier_cost.py); None: always copy what the host tier holds.
        self.tier_cost: TierCost | None = None
        if self.host is not None:
            self.pool.on_evict = self._offload

    def set_tier_cost(self, cost: TierCost | None, max_seq_len: int) -> None:
        """Let the cost model choose between copying host blocks and recomputing them; when
        no copy could ever pay on this engine, evicted blocks are not offloaded at all."""
        self.tier_cost = cost
        if self.host is not None:
            never = cost is not None and not cost.ever_pays(max_seq_len)
            self.pool.on_evict = None if never else self._offload

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
        host_hits = self._host_lookup(hashes[len(hit):max_blocks])
        cost = self.tier_cost
        if host_hits and cost is not None and not cost.restore_pays(
                len(host_hits), len(hit) * self.block_size):
            self.host_blocks_recomputed += len(host_hits)
            host_hits = []
        self._host_hits[request.request_id] = host_hits
        num_hit_tokens = (len(hit) + len(host_hits)) * self.block_size
        self._pending_stats[request.request_id] = (request.num_tokens, num_hit_tokens)
        return hit, num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights). Always succeeds."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset()
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
                if self.enable_prefix_caching \
                        and total_tokens // self.block_size > self._num_hashed[rid]:
                    self._cache_full_blocks(request, table, total_tokens)
                return True
        hits = new_computed_blocks or []
        if hits and table:
            raise ValueError(f"request {rid!r} already has blocks: prefix hits only on admission")
        host_hits = self._host_hits.pop(rid, []) if new_computed_blocks is not None else []
        num_hit = len(hits) + len(host_hits)
        total_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
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
            for block_hash, _ in host_hits:  # offloads this allocation causes must not reuse them
                self.host.pin(block_hash)
            new_blocks = self.pool.allocate(num_needed)
            self._restore_host_hits(host_hits, new_blocks)
            table.extend(new_blocks)
            self._num_hashed[rid] = num_hit
        if new_computed_blocks is not None:
            self._commit_stats(rid)
        self._cache_full_blocks(request, table, total_tokens)
        return True

    # ---- host tier ---------------------------------------------------------------------
    def take_transfers(self) -> list[Transfer]:
        """The block copies to make before the next forward, in order (then forgotten)."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def offload_request(self, request: Request) -> None:
        """Swap preemption: copy the request's written, cached blocks to the host tier now,
        so its resume finds them there even if the GPU evicts them first."""
        if self.host is None:
            return
        rid = request.request_id
        table = self._tables.get(rid, [])
        num_written = min(self._num_hashed.get(rid, 0),
                          request.num_computed_tokens // self.block_size)
        # Released entries (NULL_BLOCK) are not this request's blocks: nothing to copy.
        for block_id in table[self._num_released.get(rid, 0):num_written]:
            block_hash = self.pool.block_hash[block_id]
            if block_hash is not None:
                self._offload(block_id, block_hash)

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        host_id = self.host.store(block_hash)
        if host_id is not None:
            self._transfers.append(("out", block_id, host_id))
            self.blocks_offloaded += 1

    def _host_lookup(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, int]]:
        """The chain's continuation in the host tier: (hash, host block) while it hits."""
        found = []
        if self.host is not None:
            for block_hash in hashes:
                host_id = self.host.lookup(block_hash)
                if host_id is None:
                    break
                found.append((block_hash, host_id))
        return found

    def _restore_host_hits(self, host_hits: list[tuple[BlockHash, int]],
                           new_blocks: list[int]) -> None:
        """Queue the copies of host hits into the first new blocks and cache them there (the
        copies run before the forward that reads them)."""
        for (block_hash, host_id), block_id in zip(host_hits, new_blocks):
            self._transfers.append(("in", host_id, block_id))
            self.pool.cache_block(block_id, block_hash)  # a duplicate stays private
        if host_hits:
            self.host.unpin_all()
            self.host_hits += len(host_hits) * self.block_size

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
        self._host_hits.pop(rid, None)
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

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give `child` the parent's computed KV (beam search): full blocks shared (one more
        reference each), the partly filled last block copied into a fresh block (copy on
        write). Returns the (source, destination) block pairs the runner must copy before the
        next forward, or None, changing nothing, when no block is free for the copy."""
        pid, cid = parent.request_id, child.request_id
        table = self._tables.get(pid, [])
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return None
        # Entries released behind the sliding window stay NULL_BLOCK, owned by nobody: the
        # child's table starts with as many, and only held blocks gain a reference.
        released = min(self._num_released.get(pid, 0), num_full)
        shared = table[released:num_full]
        self.pool.touch(shared)
        copies = []
        if partial:
            (dst,) = self.pool.allocate(1)
            copies.append((table[num_full], dst))
        self._tables[cid] = [NULL_BLOCK] * released + shared + [dst for _, dst in copies]
        if released:
            self._num_released[cid] = released
        self._num_hashed[cid] = min(self._num_hashed.get(pid, 0), num_full)
        self._hashes[cid] = list(self._hashes.get(pid, [])[:num_full])
        return copies

    def refork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """`fork` into a running request that no longer needs its own KV (a beam search's
        beam not chosen): its blocks are freed first, so the copy can reuse its last one.
        None: nothing free for the copy; the child then holds no blocks.

        Sibling beams share their leading blocks (the prompt's, and those generated before
        they parted): those keep the child's reference, and only the blocks after them change
        hands, so a step costs the blocks where the beams differ, not their whole tables."""
        pid, cid = parent.request_id, child.request_id
        ptable, ctable = self._tables.get(pid, []), self._tables.get(cid)
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if not ctable or self._num_released.get(pid) or self._num_released.get(cid):
            self.free(child)
            return self.fork(parent, child)
        keep = 0
        while keep < min(num_full, len(ctable)) and ctable[keep] == ptable[keep]:
            keep += 1
        first_unwritten = max(child.num_computed_tokens // self.block_size, keep)
        for block_id in ctable[first_unwritten:]:  # as free(): withdraw unwritten hashes
            if self.pool.ref_cnt[block_id] == 1:
                self.pool.uncache_block(block_id)
        self.pool.free(reversed(ctable[keep:]))
        del ctable[keep:]
        for table in (self._pending_stats, self._host_hits):
            table.pop(cid, None)
        if partial and self.pool.num_free_blocks < 1:
            self.free(child)
            return None
        shared = ptable[keep:num_full]
        self.pool.touch(shared)
        ctable.extend(shared)
        copies = []
        if partial:
            (dst,) = self.pool.allocate(1)
            copies.append((ptable[num_full], dst))
            ctable.append(dst)
        self._num_hashed[cid] = min(self._num_hashed.get(pid, 0), num_full)
        self._hashes[cid] = list(self._hashes.get(pid, [])[:num_full])
        return copies

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
        num_hashed = self._num_hashed[rid]
        if total_tokens // self.block_size <= num_hashed:
            return  # most decode steps: no block filled since the last call
        # Only blocks whose tokens are all known (multi-step decode reserves slots ahead; an
        # async step's sampled token is a placeholder until read).
        num_full = min(total_tokens, request.num_known_tokens) // self.block_size
        start = max(num_hashed, self._num_released.get(rid, 0))
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
    """Per-request salt folded into the first block's hash (isolates tenants / adapters: K/V
    computed under one LoRA adapter is never served to another, nor to the base model)."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_int_id", 0)
    key = str(salt) if salt is not None else None
    if lora:
        key = f"{key or ''}\x00lora:{lora}"
    return key
