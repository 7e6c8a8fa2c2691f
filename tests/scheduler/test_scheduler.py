"""Scheduler policy without a model: budgets, chunked prefill, admission, preemption, stops."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
from paged_sim import PagedSim

from slipstream.config import CacheConfig, SchedulerConfig
from slipstream.engine.request import Request, RequestStatus
from slipstream.kv_cache.hashing import hash_request_tokens
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import RunnerOutput
from slipstream.scheduler.scheduler import Scheduler

_clock = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_tokens=64, max_num_seqs=8,
                   max_model_len=128, prefix=True, chunked=True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                        max_model_len=max_model_len, enable_chunked_prefill=chunked),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
    )


def make_request(rid, prompt, priority=0, eos=(), **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos),
                   priority=priority, arrival_time=float(next(_clock)))


def step(sched: Scheduler, tokens: dict[str, list[int]] | None = None, default: int = 1):
    """One schedule + fake runner (fixed tokens) + update. Returns (sched_out, outputs)."""
    out = sched.schedule()
    ro = RunnerOutput()
    for seq in out.seqs:
        if seq.needs_sample:
            ro.sampled_token_ids[seq.request_id] = list((tokens or {}).get(seq.request_id, [default]))
    return out, sched.update_from_output(out, ro)


def run_sim(sched: Scheduler, sim: PagedSim, max_steps: int = 1000) -> dict[str, list]:
    """Drive to completion with the paging simulator; returns all outputs per request."""
    got: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_tokens
        for o in sched.update_from_output(out, sim.execute(out)):
            got.setdefault(o.request_id, []).append(o)
    raise AssertionError("did not finish")


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


# ---- admission ---------------------------------------------------------------------------
def test_add_rejects_requests_that_can_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="64 tokens but max_model_len is 64"):
        sched.add_request(make_request("long", range(64)))
    with pytest.raises(ValueError, match="needs 5 KV blocks.*has 4"):
        sched.add_request(make_request("big", range(16)))  # 16 + 1 tokens > 16 slots
    sched.add_request(make_request("ok", range(15)))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("ok", range(3)))
    assert sched.num_waiting == 1 and sched.kv.num_free_blocks == 4
    no_chunk = make_scheduler(max_num_tokens=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        no_chunk.add_request(make_request("x", range(9)))


def test_max_tokens_none_becomes_room_left_without_touching_shared_params():
    sched = make_scheduler(max_model_len=20)
    params = SamplingParams(max_tokens=None)
    a = Request("a", list(range(5)), params)
    b = Request("b", list(range(12)), params)
    sched.add_request(a)
    sched.add_request(b)
    assert a.sampling_params.max_tokens == 15 and b.sampling_params.max_tokens == 8
    assert params.max_tokens is None


# ---- budgets and chunked prefill ---------------------------------------------------------
def test_chunked_prefill_splits_long_prompt_while_decodes_continue():
    sched = make_scheduler(max_num_tokens=10, max_num_seqs=4)
    for rid in ("d1", "d2"):
        sched.add_request(make_request(rid, range(3), max_tokens=50))
    step(sched)  # both prefills (3 + 3 tokens)
    sched.add_request(make_request("long", range(30), max_tokens=2))
    chunks = []
    for _ in range(4):
        out, _ = step(sched)
        by_id = {s.request_id: s for s in out.seqs}
        assert by_id["d1"].num_tokens == 1 and by_id["d2"].num_tokens == 1  # decodes go on
        assert out.num_batched_tokens <= 10
        chunks.append((by_id["long"].start_pos, by_id["long"].num_tokens,
                       by_id["long"].needs_sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert sched.get_request("long").num_output_tokens == 1


def test_budget_and_seq_limit_every_step():
    sched = make_scheduler(max_num_tokens=7, max_num_seqs=3, num_blocks=200)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", range(5 + i), max_tokens=3))
    steps = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert out.num_batched_tokens <= 7 and len(out.seqs) <= 3
        assert sched.num_running <= 3
        steps += 1
        assert steps < 200
    assert sched.kv.num_free_blocks == 200


def test_waiting_request_that_does_not_fit_blocks_admission():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_tokens=100)
    sched.add_request(make_request("a", range(14), max_tokens=1))  # 4 blocks
    sched.add_request(make_request("big", range(50, 60), max_tokens=1))  # needs 3: waits
    sched.add_request(make_request("small", range(70, 72), max_tokens=1))  # fits, waits too
    out, _ = step(sched)
    assert [s.request_id for s in out.seqs] == ["a"]
    out, _ = step(sched)  # a finished last step and freed its blocks
    assert [s.request_id for s in out.seqs] == ["big", "small"]
    assert out.finished_request_ids == ["a"]


def test_priority_orders_admission():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("low", range(3), priority=5, max_tokens=1))
    sched.add_request(make_request("high", range(3), priority=-1, max_tokens=1))
    out, _ = step(sched)
    assert [s.request_id for s in out.seqs] == ["high"]


# ---- preemption --------------------------------------------------------------------------
def _fill(sched, specs):
    for rid, prio in specs:
        sched.add_request(make_request(rid, range(100, 104), priority=prio, max_tokens=40,
                                       ignore_eos=True))
    step(sched)


def test_preemption_picks_lowest_priority_then_latest_arrival():
    # 4 requests x 1 block of 4 prompt tokens; the 5th token of each needs a new block.
    sched = make_scheduler(num_blocks=6, block_size=4, prefix=False)
    _fill(sched, [("a", 0), ("b", 1), ("c", 1), ("d", 0)])
    out, _ = step(sched)  # a and b get the 2 free blocks; c must go: priority 1, after b
    assert out.preempted_request_ids == ["c"]  # its freed block serves d
    assert sched.get_request("c").status == RequestStatus.PREEMPTED
    assert {s.request_id for s in out.seqs} == {"a", "b", "d"}
    preempted = []
    while not preempted:  # a, b, d fill their 2nd blocks; then the 9th token needs a 3rd
        out, _ = step(sched)
        preempted = out.preempted_request_ids
    assert preempted == ["b"]  # priority 1 goes before d (priority 0, arrived later)
    assert sched.num_preemptions == 2 and sched.get_stats()["num_preemptions"] == 2
    assert {s.request_id for s in out.seqs} == {"a", "d"}
    assert [s.start_pos for s in out.seqs] == [8, 8]


def test_request_may_preempt_itself_and_refunds_budget():
    sched = make_scheduler(num_blocks=2, block_size=4, prefix=False)
    _fill(sched, [("a", 0), ("b", 7)])
    out, _ = step(sched)  # a needs a block: b is the victim
    assert out.preempted_request_ids == ["b"] and [s.request_id for s in out.seqs] == ["a"]
    sched2 = make_scheduler(num_blocks=2, block_size=4, prefix=False)
    _fill(sched2, [("a", 7), ("b", 0)])
    out, _ = step(sched2)  # a is itself the lowest priority: it goes, b runs
    assert out.preempted_request_ids == ["a"] and [s.request_id for s in out.seqs] == ["b"]


def test_victim_scheduled_earlier_in_the_step_is_unscheduled():
    sched = make_scheduler(num_blocks=3, block_size=4, prefix=False)
    # "low" is admitted first (so it runs first each step) but has the lowest priority.
    sched.add_request(make_request("low", range(3), priority=9, max_tokens=40, ignore_eos=True))
    step(sched)
    sched.add_request(make_request("hi", range(4), priority=0, max_tokens=40, ignore_eos=True))
    step(sched)  # low: 5 tokens, hi: 5 tokens, 1 block each
    out, _ = step(sched)  # low takes the last block for its 5th; hi then needs one: low goes
    assert out.preempted_request_ids == ["low"]
    assert [(s.request_id, s.start_pos) for s in out.seqs] == [("hi", 4)]
    assert out.num_batched_tokens == 1  # low's token was given back
    assert sched.kv.get_block_ids("low") == [] and len(sched.kv.get_block_ids("hi")) == 2
    assert sched.kv.num_free_blocks == 1


def test_preemption_refunds_the_victims_tokens_to_later_requests():
    sched = make_scheduler(num_blocks=4, block_size=4, prefix=False)
    sched.add_request(make_request("low", [1], priority=9, max_tokens=40, ignore_eos=True))
    step(sched)
    sched.add_request(make_request("hi", range(10, 14), max_tokens=40, ignore_eos=True))
    sched.add_request(make_request("mid", range(20, 25), max_tokens=40, ignore_eos=True))
    step(sched)  # low: 3 tokens (1 block), hi: 5 (1 block), mid: 6 (2 blocks); cache full
    sched.config = dataclasses.replace(sched.config, max_num_tokens=2)
    out, _ = step(sched)  # low: 1; hi needs a block -> low goes, its token back; hi 1, mid 1
    assert out.preempted_request_ids == ["low"]
    assert [(s.request_id, s.start_pos) for s in out.seqs] == [("hi", 4), ("mid", 5)]


def test_blocks_registered_for_a_step_that_never_ran_are_withdrawn():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=64)
    low = make_request("low", range(6), priority=9, max_tokens=40, ignore_eos=True)
    sched.add_request(low)
    step(sched)  # low: 7 tokens, 2 blocks
    sched.add_request(make_request("hi", range(10, 18), max_tokens=40, ignore_eos=True))
    step(sched)  # low computes position 6; hi takes the other 2 blocks
    out, _ = step(sched)  # low fills block 1 (registered), then hi's 9th token preempts low
    assert out.preempted_request_ids == ["low"]
    hashes = hash_request_tokens(low.all_token_ids, 4)
    pool = sched.kv.pool
    assert pool.get_cached_block(hashes[0]) is not None  # written two steps ago
    assert pool.get_cached_block(hashes[1]) is None  # its K/V was never written


def test_preempted_request_resumes_recomputes_and_matches():
    def run(num_blocks, prefix):
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_tokens=16,
                               prefix=prefix)
        sim = PagedSim(num_blocks, 4)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", range(i, i + 6), priority=i % 2,
                                           max_tokens=20, ignore_eos=True))
        got = run_sim(sched, sim)
        assert sched.kv.num_free_blocks == num_blocks
        return sched, {rid: tokens_of(o) for rid, o in got.items()}

    roomy, ref = run(64, prefix=False)
    assert roomy.num_preemptions == 0
    for prefix in (False, True):
        tight, got = run(12, prefix)  # 4 x 26 tokens cannot fit 48 slots together
        assert tight.num_preemptions > 0
        assert got == ref  # PagedSim also checked every step's context through the pages


def test_resume_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=3, block_size=4, prefix=False)
    _fill(sched, [("a", 0), ("b", 1)])  # 4 prompt tokens each, 1 output each
    step(sched)  # a, b: 5 tokens (2 blocks a, b 1 more) -> b preempted
    b = sched.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    sched.abort_requests(["a"])
    before = b.all_token_ids  # 4 prompt + 1 output token
    out, _ = step(sched)
    (seq,) = out.seqs
    assert seq.request_id == "b" and seq.start_pos == 0 and len(before) == 5
    assert seq.token_ids == before and seq.needs_sample
    assert b.num_output_tokens == 2 and b.num_cached_tokens == 0


# ---- prefix caching through the scheduler ------------------------------------------------
def test_prefix_hits_counted_and_blocks_shared():
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(make_request("a", range(18), max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", list(range(16)) + [77, 78, 79], max_tokens=5))
    out, _ = step(sched)
    seq_b = next(s for s in out.seqs if s.request_id == "b")
    assert seq_b.start_pos == 16 and seq_b.token_ids == [77, 78, 79]
    assert sched.get_request("b").num_cached_tokens == 16
    shared = sched.kv.get_block_ids("a")[:4]
    assert sched.kv.get_block_ids("b")[:4] == shared
    assert all(sched.kv.pool.ref_cnt[x] == 2 for x in shared)
    stats = sched.get_stats()
    assert stats["prefix_cache_queries"] == 18 + 19 and stats["prefix_cache_hits"] == 16


def test_same_step_sharing_matches_unshared_output():
    prompt = list(range(3, 23))
    results = []
    for prefix in (False, True):
        sched = make_scheduler(num_blocks=32, block_size=4, prefix=prefix)
        for rid in ("x", "y", "z"):
            sched.add_request(make_request(rid, prompt, max_tokens=6, ignore_eos=True))
        got = run_sim(sched, PagedSim(32, 4))
        results.append({rid: tokens_of(o) for rid, o in got.items()})
        hits = sched.get_stats()["prefix_cache_hits"]
        assert hits == (32 if prefix else 0)  # y and z reuse 4 blocks that x fills this step
    assert results[0] == results[1]


# ---- stops and outputs -------------------------------------------------------------------
def test_stop_conditions():
    sched = make_scheduler()
    reqs = [
        make_request("eos", range(3), eos=(2,), max_tokens=10),
        make_request("min", range(3), eos=(2,), min_tokens=2, max_tokens=10),
        make_request("ign", range(3), eos=(2,), ignore_eos=True, max_tokens=3),
        make_request("stop", range(3), stop_token_ids=[2], max_tokens=10),
        make_request("len", range(3), max_tokens=2),
    ]
    for r in reqs:
        sched.add_request(r)
    done = {}
    for _ in range(5):
        for o in step(sched, default=2)[1]:
            if o.finished:
                done[o.request_id] = (o.finish_reason, o.stop_reason)
    assert done == {
        "eos": ("stop", None),
        "stop": ("stop", 2),  # stop_reason: the stop token id
        "len": ("length", None),
        "ign": ("length", None),  # EOS ignored until max_tokens
        "min": ("stop", None),
    }
    assert [r.num_output_tokens for r in reqs] == [1, 2, 3, 1, 2]  # min: EOS counts from #2
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64


def test_min_tokens_and_stop_token_counts():
    sched = make_scheduler()
    req = make_request("m", range(3), eos=(2,), min_tokens=3, max_tokens=10)
    sched.add_request(req)
    for _ in range(5):
        step(sched, default=2)
    assert req.output_token_ids == [2, 2, 2] and req.status == RequestStatus.FINISHED_STOPPED


def test_multi_token_output_truncated_at_stop_and_finished_freed_same_call():
    sched = make_scheduler()
    req = make_request("r", range(3), stop_token_ids=[9], max_tokens=10)
    sched.add_request(req)
    out, outs = step(sched, tokens={"r": [4, 9, 5]})
    assert req.output_token_ids == [4, 9] and outs[0].new_token_ids == [4, 9]
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 9
    assert sched.kv.num_free_blocks == 64 and sched.get_request("r") is None
    sched.add_request(make_request("r2", range(3)))
    assert sched.schedule().finished_request_ids == ["r"]


def test_max_model_len_and_cache_capacity_end_with_length():
    sched = make_scheduler(max_model_len=6)
    req = make_request("r", range(4), max_tokens=10)
    sched.add_request(req)
    for _ in range(4):
        step(sched)
    assert req.num_tokens == 6 and req.status == RequestStatus.FINISHED_LENGTH
    # A cache of 2 blocks x 4 holds 8 tokens: the 9th token is the last one possible.
    tiny = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    lone = make_request("lone", range(5), max_tokens=50)
    tiny.add_request(lone)
    for _ in range(10):
        step(tiny)
    assert lone.num_tokens == 9 and lone.status == RequestStatus.FINISHED_LENGTH


def test_outputs_carry_logprobs_timestamps_and_cached_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("r", range(5), max_tokens=2))
    out = sched.schedule()
    ro = RunnerOutput(sampled_token_ids={"r": [7]}, logprobs={"r": [{7: -0.1, 3: -2.0}]})
    (o,) = sched.update_from_output(out, ro)
    assert o.new_token_ids == [7] and o.new_logprobs == [{7: -0.1, 3: -2.0}]
    assert o.num_cached_tokens == 0 and o.finish_reason is None
    assert o.timestamps["first_token_time"] >= o.timestamps["first_scheduled_time"]
    req = sched.get_request("r")
    assert req.first_scheduled_time is not None and req.first_token_time is not None


def test_scheduler_stamps_each_prompt_chunk_until_the_first_token():
    sched = make_scheduler(max_num_tokens=4)
    sched.add_request(make_request("r", range(10), max_tokens=3))
    outs = [step(sched)[1] for _ in range(4)]  # chunks of 4, 4, 2 tokens, then a decode
    assert [len(o) for o in outs] == [0, 0, 1, 1]
    stamps = outs[2][0].timestamps
    chunks = stamps["prefill_chunk_times"]
    assert len(chunks) == 3 and chunks == sorted(chunks)
    assert chunks[0] == stamps["first_scheduled_time"] <= chunks[-1] <= stamps["first_token_time"]
    assert outs[3][0].timestamps == {}  # sent once, with the first token
    assert len(sched.get_request("r").prefill_chunk_times) == 3  # the decode added none


def test_a_short_prompt_is_one_chunk():
    sched = make_scheduler()
    sched.add_request(make_request("r", range(5), max_tokens=2))
    out = sched.schedule()
    (o,) = sched.update_from_output(out, RunnerOutput(sampled_token_ids={"r": [7]}))
    assert len(o.timestamps["prefill_chunk_times"]) == 1


def test_prompt_logprobs_not_repeated_after_preemption():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=6, prefix=False)
    sim = PagedSim(4, 4)
    sched.add_request(make_request("a", range(8), max_tokens=8, ignore_eos=True))
    sched.add_request(make_request("p", range(20, 27), priority=1, max_tokens=3,
                                   ignore_eos=True, prompt_logprobs=1))
    got = run_sim(sched, sim)
    assert sched.num_preemptions > 0
    positions = [e for o in got["p"] if o.prompt_logprobs for e in o.prompt_logprobs]
    assert positions == [None] + [{p: 0.0} for p in range(1, 7)]


# ---- abort -------------------------------------------------------------------------------
def test_abort_running_and_waiting_frees_now():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", range(9), max_tokens=10))
    sched.add_request(make_request("wait", range(9), max_tokens=10))
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    aborted = sched.abort_requests(["run", "wait", "nope"])
    assert [r.request_id for r in aborted] == ["run", "wait"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.kv.num_free_blocks == 64 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == []  # kept for the next real step
    sched.add_request(make_request("next", range(3)))
    assert sched.schedule().finished_request_ids == ["run", "wait"]
    stopped = make_scheduler()
    stopped.add_request(make_request("s", range(3)))
    (r,) = stopped.abort_requests(["s"], status=RequestStatus.FINISHED_STOPPED)
    assert r.status.finish_reason == "stop"
