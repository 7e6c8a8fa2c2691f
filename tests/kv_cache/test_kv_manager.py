"""KVCacheManager: block tables, prefix hits (shared blocks, stats), allocation failure, free."""
from __future__ import annotations

import pytest

from slipstream.engine.request import Request
from slipstream.kv_cache.manager import KVCacheManager
from slipstream.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params))


def _admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """Prefix lookup + allocation like the scheduler does; returns the hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, hits)
    req.num_computed_tokens = num_hit
    return num_hit



def test_block_table_grows_and_frees():
    kv = KVCacheManager(8, BS)
    req = _req("a", list(range(10)))
    _admit(kv, req)
    assert len(kv.get_block_ids("a")) == 3  # 10 tokens -> 3 blocks of 4
    req.num_computed_tokens = 10
    req.output_token_ids.append(99)
    assert kv.allocate_slots(req, 1)  # token 11 still fits block 3
    assert len(kv.get_block_ids("a")) == 3
    req.num_computed_tokens = 11
    req.output_token_ids.append(98)
    assert kv.allocate_slots(req, 1)  # ... and 12 too; 13 needs a 4th block
    req.num_computed_tokens = 12
    req.output_token_ids.append(97)
    assert kv.allocate_slots(req, 1)
    assert len(kv.get_block_ids("a")) == 4
    assert kv.num_free_blocks == 4 and kv.usage == pytest.approx(0.5)
    kv.free(req)
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []
    assert all(c == 0 for c in kv.pool.ref_cnt)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    b = _req("b", list(range(100, 108)))
    hits, _ = kv.get_computed_blocks(b)
    assert not kv.allocate_slots(b, 8, hits)
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.prefix_cache_queries == 12  # b's failed lookup is not counted (yet)


def test_prefix_hit_shares_blocks_and_counts_tokens():
    kv = KVCacheManager(16, BS)
    prompt = list(range(20))
    a = _req("a", prompt)
    assert _admit(kv, a) == 0
    a.num_computed_tokens = 20
    b = _req("b", prompt[:13] + [500, 501])
    assert _admit(kv, b) == 12  # three full shared blocks; the 4th differs
    shared = kv.get_block_ids("a")[:3]
    assert kv.get_block_ids("b")[:3] == shared
    assert kv.get_block_ids("b")[3] not in kv.get_block_ids("a")
    assert all(kv.pool.ref_cnt[x] == 2 for x in shared)
    assert kv.prefix_cache_queries == 20 + 15 and kv.prefix_cache_hits == 12
    kv.free(a)
    assert all(kv.pool.ref_cnt[x] == 1 for x in shared)
    kv.free(b)
    assert kv.num_free_blocks == 16 and all(c == 0 for c in kv.pool.ref_cnt)


def test_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(16, BS)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    a.num_computed_tokens = 8
    b = _req("b", list(range(8)))  # identical, block-aligned prompt
    assert _admit(kv, b) == 4  # (8 - 1) // 4 = 1 block: one token left to sample from


def test_freed_blocks_stay_reusable_until_evicted():
    kv = KVCacheManager(4, BS)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    a.num_computed_tokens = 9
    kv.free(a)
    b = _req("b", list(range(9)))
    assert _admit(kv, b) == 8  # hit after a left
    b.num_computed_tokens = 9
    kv.free(b)
    # A big unrelated request evicts everything; then nothing hits.
    c = _req("c", list(range(100, 116)))
    _admit(kv, c)
    c.num_computed_tokens = 16
    kv.free(c)
    d = _req("d", list(range(9)))
    assert _admit(kv, d) == 0


def test_hit_blocks_are_not_evicted_by_the_same_allocation():
    kv = KVCacheManager(3, BS)
    a = _req("a", list(range(8)) + [1])
    _admit(kv, a)
    a.num_computed_tokens = 9
    kv.free(a)  # all 3 blocks free; two of them cached
    b = _req("b", list(range(8)) + [2, 3, 4, 5])
    assert _admit(kv, b) == 8  # needs 1 new block besides the 2 hits: fits exactly
    assert len(set(kv.get_block_ids("b"))) == 3
    c = _req("c", list(range(8)) + [7])
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8
    assert not kv.allocate_slots(c, 1, hits)  # no free block for its last token


def test_unwritten_blocks_are_not_left_in_the_cache():
    """A block registered for a step that never ran (preempted/aborted) must not be hit."""
    kv = KVCacheManager(8, BS)
    a = _req("a", list(range(12)))
    _admit(kv, a)  # registers 3 full blocks, K/V not yet written
    kv.free(a)  # num_computed_tokens is still 0
    b = _req("b", list(range(12)))
    assert _admit(kv, b) == 0


def test_output_blocks_are_cached_as_they_fill():
    kv = KVCacheManager(8, BS)
    a = _req("a", list(range(6)))
    _admit(kv, a)
    a.num_computed_tokens = 6
    a.output_token_ids += [50, 51]
    assert kv.allocate_slots(a, 2)  # computes positions 6, 7: block 2 full
    a.num_computed_tokens = 8
    a.output_token_ids.append(52)
    kv.free(a)
    resumed = _req("a2", a.all_token_ids)
    assert _admit(kv, resumed) == 8


def test_prompt_logprobs_skip_lookup_and_salt_isolates():
    kv = KVCacheManager(16, BS)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    a.num_computed_tokens = 9
    assert _admit(kv, _req("b", list(range(9)), prompt_logprobs=1)) == 0
    salted = _req("c", list(range(9)))
    salted.cache_salt = "other-tenant"
    assert _admit(kv, salted) == 0
    assert _admit(kv, _req("d", list(range(9)))) == 8


def test_prefix_caching_disabled_and_reset():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    a.num_computed_tokens = 9
    assert _admit(kv, _req("b", list(range(9)))) == 0
    assert kv.prefix_cache_queries == 0
    kv2 = KVCacheManager(8, BS)
    a = _req("a", list(range(9)))
    _admit(kv2, a)
    a.num_computed_tokens = 9
    assert kv2.reset_prefix_cache()
    assert _admit(kv2, _req("b", list(range(9)))) == 0


def test_hits_only_on_admission():
    kv = KVCacheManager(8, BS)
    a = _req("a", list(range(5)))
    _admit(kv, a)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots(a, 1, [3])


def test_sliding_window_releases_blocks_behind_it():
    """Window 6, blocks of 4: before computing from token c, blocks wholly below c - 5 go back
    to the pool (their entries read NULL_BLOCK); free and trim skip them; the cached ones stay
    reusable as prefix hits."""
    from slipstream.kv_cache.manager import NULL_BLOCK

    kv = KVCacheManager(16, BS, sliding_window=6)
    req = _req("a", list(range(20)))
    _admit(kv, req, num_new=8)
    first_two = kv.get_block_ids("a")[:2]
    req.num_computed_tokens = 8  # next queries at 8.. see keys from 3 on: block 0 still needed
    assert kv.allocate_slots(req, 8)
    assert kv.num_held_blocks("a") == 4 and kv.num_free_blocks == 12
    req.num_computed_tokens = 16  # keys from 11 on: blocks 0 and 1 released, 2 (8-11) kept
    assert kv.allocate_slots(req, 4)
    assert kv.get_block_ids("a")[:2] == [NULL_BLOCK] * 2
    assert kv.num_held_blocks("a") == 3 and kv.num_free_blocks == 13
    assert kv.peak_blocks(10_000, 8) == 5  # cdiv(6 - 1 + 8, 4) + 1
    req.num_computed_tokens = 20
    kv.trim(req, 20)
    kv.free(req)
    assert kv.num_free_blocks == 16
    other = _req("b", list(range(20)))  # same prompt: the released blocks are prefix hits
    hits, num_hit = kv.get_computed_blocks(other)
    assert hits[:2] == first_two and num_hit == 16


def _past_the_window(kv: KVCacheManager) -> Request:
    """A 20-token request with 18 computed under window 6: blocks 0 and 1 released."""
    req = _req("a", list(range(20)))
    _admit(kv, req, num_new=8)
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 16
    assert kv.allocate_slots(req, 4)
    req.num_computed_tokens = 18
    return req


def test_fork_keeps_released_entries_unreferenced():
    """Beam search's fork past the window: the child's first entries are NULL_BLOCK without a
    reference, the held full blocks are shared, the partial one copied; both free cleanly."""
    from slipstream.kv_cache.manager import NULL_BLOCK

    kv = KVCacheManager(16, BS, sliding_window=6)
    parent = _past_the_window(kv)
    table = list(kv.get_block_ids("a"))
    null_refs = kv.pool.ref_cnt[NULL_BLOCK]
    child = _req("b", list(range(20)))
    copies = kv.fork(parent, child)
    child.num_computed_tokens = 18
    assert copies == [(table[4], kv.get_block_ids("b")[4])]
    assert kv.get_block_ids("b")[:4] == [NULL_BLOCK, NULL_BLOCK, table[2], table[3]]
    assert kv.pool.ref_cnt[NULL_BLOCK] == null_refs
    assert [kv.pool.ref_cnt[b] for b in table[2:4]] == [2, 2]
    assert kv.num_held_blocks("b") == 3
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 16


def test_host_offload_skips_released_entries():
    kv = KVCacheManager(16, BS, num_host_blocks=8, sliding_window=6)
    req = _past_the_window(kv)
    held = kv.get_block_ids("a")[2:4]
    kv.offload_request(req)
    outs = [t for t in kv.take_transfers() if t[0] == "out"]
    assert sorted(src for _, src, _ in outs) == sorted(held)
    assert kv.blocks_offloaded == 2


def test_refork_moves_a_beam_onto_its_sibling():
    """A beam not chosen becomes a fork of a chosen one: its own blocks are freed, the
    parent's full blocks shared, its partial block copied (into the block just freed when it
    is the only free one); with no block free for the copy it holds nothing (None)."""
    kv = KVCacheManager(4, BS)
    parent, spare = _req("p", list(range(6))), _req("s", list(range(7)))
    _admit(kv, parent)  # 2 blocks: one full, one partial
    parent.num_computed_tokens = 6
    _admit(kv, spare)  # shares the full block, its own partial one
    spare.num_computed_tokens = 7
    assert kv.num_free_blocks == 1
    spare_partial = kv.get_block_ids("s")[1]
    copies = kv.refork(parent, spare)
    spare.num_computed_tokens = 6
    assert kv.get_block_ids("s")[0] == kv.get_block_ids("p")[0]
    assert copies == [(kv.get_block_ids("p")[1], kv.get_block_ids("s")[1])]
    assert kv.pool.ref_cnt[kv.get_block_ids("p")[0]] == 2
    assert kv.num_free_blocks == 1 and spare_partial not in kv.get_block_ids("p")
    # Every block taken, and the spare's only block is shared: no block for the copy.
    other = _req("o", list(range(4)))
    _admit(kv, other)
    other.num_computed_tokens = 4
    assert kv.num_free_blocks == 0
    sharer = _req("x", list(range(4)))
    assert kv.fork(other, sharer) == []  # a whole block: shared, nothing to copy
    sharer.num_computed_tokens = 4
    assert kv.refork(parent, sharer) is None
    assert kv.get_block_ids("x") == []
    for req in (parent, spare, other):
        kv.free(req)
    assert kv.num_free_blocks == 4 and not any(kv.pool.ref_cnt)


def test_random_forks_and_reforks_keep_reference_counts():
    """Beam-search-like churn: beams grow, fork, and unchosen ones are re-pointed at siblings.
    Every block's reference count stays the number of tables holding it, and all blocks come
    back at the end."""
    import random

    rng = random.Random(0)
    kv = KVCacheManager(40, BS)
    root = _req("r0", list(range(6)))
    _admit(kv, root)
    root.num_computed_tokens = 6
    beams, next_id = [root], 1
    for _ in range(60):
        op = rng.random()
        if op < 0.4 and len(beams) < 6:  # fork a new beam
            child = _req(f"r{next_id}", [])
            next_id += 1
            parent = rng.choice(beams)
            if kv.fork(parent, child) is not None:
                child.num_computed_tokens = parent.num_computed_tokens
                beams.append(child)
        elif op < 0.7 and len(beams) > 1:  # re-point one beam at another
            child, parent = rng.sample(beams, 2)
            if kv.refork(parent, child) is None:
                beams.remove(child)
            else:
                child.num_computed_tokens = parent.num_computed_tokens
        else:  # a beam computes one more token
            beam = rng.choice(beams)
            if kv.allocate_slots(beam, 1):
                beam.num_computed_tokens += 1
        held = {}
        for beam in beams:
            for block_id in kv.get_block_ids(beam.request_id):
                held[block_id] = held.get(block_id, 0) + 1
        assert all(kv.pool.ref_cnt[b] == n for b, n in held.items())
        assert sum(kv.pool.ref_cnt) == sum(held.values())
    for beam in beams:
        kv.free(beam)
    assert kv.num_free_blocks == 40 and not any(kv.pool.ref_cnt)
