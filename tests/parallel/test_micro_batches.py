"""Pipeline micro-batches without a model: the engine core's MicroBatches drives the real
scheduler and KV manager, and a paging simulator stands in for the stages (each micro-batch
runs when sent, as the stages run them in the order sent; its tokens come back only when
read). Random arrivals, aborts and preemptions (a small cache): every input token is known
when sent, every K/V read back is right, each request gets the tokens a lone run gives, and
nothing leaks."""
from __future__ import annotations

import random

import pytest

from slipstream.config import CacheConfig, SchedulerConfig
from slipstream.engine.request import PENDING_TOKEN, Request
from slipstream.parallel.micro_batches import MicroBatches
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.scheduler import Scheduler
from tests.scheduler.paged_sim import PagedSim, chain, true_value

VOCAB = 24


class Stages:
    """A DistributedRunner stand-in for MicroBatches."""

    def __init__(self, sim: PagedSim):
        self.sim = sim
        self.replies: dict[int, object] = {}
        self.sent: list[list[str]] = []  # request ids of each micro-batch

    def launch_step(self, sched_out) -> int:
        for seq in sched_out.seqs:
            assert PENDING_TOKEN not in seq.token_ids, "a token still in flight was fed"
        self.replies[len(self.sent)] = self.sim.execute(sched_out)
        self.sent.append([s.request_id for s in sched_out.seqs])
        return len(self.sent) - 1

    def collect_step(self, micro_batch: int):
        assert micro_batch == min(self.replies), "replies are read oldest first"
        return self.replies.pop(micro_batch)


def _pipe(depth: int, num_blocks: int, max_num_seqs: int = 6, max_num_tokens: int = 16):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                                      max_model_len=48),
                      CacheConfig(block_size=4, num_blocks=num_blocks))
    stages = Stages(PagedSim(num_blocks, 4, vocab=VOCAB))
    pipe = MicroBatches(depth, sched, stages,
                        lambda sched_out, out, _: sched.update_from_output(sched_out, out))
    return pipe, sched, stages


def _lone_run(prompt: list[int], max_tokens: int) -> list[int]:
    """The simulator's tokens for a request alone (each depends on the whole prefix)."""
    value, out = true_value(prompt), []
    for _ in range(max_tokens):
        out.append(value % VOCAB)
        value = chain(value, out[-1])
    return out


@pytest.mark.parametrize("depth", [2, 3])
def test_random_arrivals_aborts_and_preemptions(depth) -> None:
    rng = random.Random(depth)
    pipe, sched, stages = _pipe(depth, num_blocks=14)
    prompts, tokens, aborted, finished = {}, {}, set(), set()
    for i in range(400):
        if i < 300 and rng.random() < 0.2:
            rid = f"r{i}"
            prompts[rid] = ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
                            rng.choice([1, 4, 9, 16]))
            tokens[rid] = []
            sched.add_request(Request(rid, prompts[rid][0], SamplingParams(
                max_tokens=prompts[rid][1], ignore_eos=True)))
        elif rng.random() < 0.03 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_requests([rid])
            aborted.add(rid)
        for out in pipe.step(lambda: None):
            assert out.request_id not in aborted | finished
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    while sched.has_unfinished_requests() or len(pipe):
        for out in pipe.step(lambda: None):
            tokens[out.request_id] += out.new_token_ids
            finished.add(out.request_id)
    for rid, (prompt, max_tokens) in prompts.items():
        want = _lone_run(prompt, max_tokens)
        assert tokens[rid] == (want[:len(tokens[rid])] if rid in aborted else want), rid
    assert pipe.max_in_flight == depth and sched.num_preemptions > 0
    assert len(finished) > 40
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_total_blocks and not kv._tables


def test_running_requests_take_turns_in_groups() -> None:
    """Six decoding requests on two stages: two groups of three alternate, each micro-batch
    disjoint from the one in flight beside it."""
    pipe, sched, stages = _pipe(2, num_blocks=64)
    for i in range(6):
        sched.add_request(Request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=12,
                                                                         ignore_eos=True)))
    while sched.has_unfinished_requests() or len(pipe):
        pipe.step(lambda: None)
    groups = [set(ids) for ids in stages.sent]
    assert len(groups) == 24 and all(len(g) == 3 for g in groups)
    assert all(not a & b for a, b in zip(groups, groups[1:]))
    assert all(a == b for a, b in zip(groups, groups[2:]))


def test_a_full_cache_still_splits_the_running_requests() -> None:
    """More requests than the cache holds: the waiting ones cannot be admitted, so the split
    counts the running ones only, and nearly every micro-batch goes out beside another
    (counting the waiting ones too put every running request in one: 44%)."""
    pipe, sched, stages = _pipe(2, num_blocks=24, max_num_seqs=16, max_num_tokens=64)
    for i in range(16):
        sched.add_request(Request(f"r{i}", [i + 1] + [2] * 11, SamplingParams(
            max_tokens=30, ignore_eos=True)))
    beside = []  # per launch: whether another micro-batch was in flight
    launch = stages.launch_step

    def counted(sched_out):
        beside.append(len(pipe) == 1)
        return launch(sched_out)

    stages.launch_step = counted
    while sched.has_unfinished_requests() or len(pipe):
        pipe.step(lambda: None)
    assert sched.num_preemptions > 0  # the cache was full
    assert sum(beside) > 0.85 * len(beside)
