"""Random add / step / abort / finish sequences against the scheduler and a paging simulator.

Every step: budgets, block-table invariants and the K/V read back through the pages; at the end:
no leaked block, every ref count back to zero, nothing left in the KV manager's books.
"""
from __future__ import annotations

import random

import pytest
from paged_sim import PagedSim

from slipstream.config import CacheConfig, SchedulerConfig
from slipstream.engine.request import Request
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.scheduler import Scheduler

CONFIGS = {
    "prefix-chunked": dict(block_size=4, num_blocks=24, max_num_tokens=24, max_num_seqs=6,
                           max_model_len=48, prefix=True, chunked=True),
    "no-prefix": dict(block_size=4, num_blocks=20, max_num_tokens=16, max_num_seqs=4,
                      max_model_len=40, prefix=False, chunked=True),
    "no-chunk-small-cache": dict(block_size=2, num_blocks=12, max_num_tokens=20, max_num_seqs=5,
                                 max_model_len=40, prefix=True, chunked=False),
    "big-blocks": dict(block_size=16, num_blocks=6, max_num_tokens=32, max_num_seqs=8,
                       max_model_len=64, prefix=True, chunked=True),
}


class Fuzz:
    def __init__(self, seed: int, cfg: dict):
        self.rng = random.Random(seed)
        self.cfg = cfg
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=cfg["max_num_seqs"], max_num_tokens=cfg["max_num_tokens"],
                            max_model_len=cfg["max_model_len"],
                            enable_chunked_prefill=cfg["chunked"]),
            CacheConfig(block_size=cfg["block_size"], num_blocks=cfg["num_blocks"],
                        enable_prefix_caching=cfg["prefix"]),
        )
        self.sim = PagedSim(cfg["num_blocks"], cfg["block_size"], vocab=24)
        self.prefixes = [[self.rng.randrange(24) for _ in range(20)] for _ in range(3)]
        self.live: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prompt_lps: dict[str, list] = {}
        self.finished: set[str] = set()
        self.delivered: list[str] = []  # SchedulerOutput.finished_request_ids seen
        self.next_id = 0

    # ---- operations ----------------------------------------------------------------------
    def random_operations(self, count: int) -> None:
        """count random operations: about a quarter adds, a few aborts, the rest steps."""
        for _ in range(count):
            r = self.rng.random()
            if r < 0.25:
                self.add()
            elif r < 0.29 and self.live:
                self.abort()
            else:
                self.step()

    def add(self) -> None:
        rng, cfg = self.rng, self.cfg
        length = rng.choice([0, 1, 2, 5, 9, 17, 30, cfg["max_model_len"] - 1,
                             cfg["max_model_len"], cfg["block_size"] * cfg["num_blocks"]])
        length = rng.randint(1, 30) if rng.random() < 0.6 else length
        prompt = (rng.choice(self.prefixes) + [rng.randrange(24) for _ in range(length)])[:length]
        max_tokens = rng.choice([None, 1, 3, 8, 20])
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 1, 3]), max_tokens or 3),
            ignore_eos=rng.random() < 0.2, stop_token_ids=rng.sample(range(24), rng.randint(0, 1)),
            prompt_logprobs=1 if rng.random() < 0.15 else None)
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, prompt, params, eos_token_ids=(0,), priority=rng.randint(0, 2))
        if self._never_fits(len(prompt)):
            with pytest.raises(ValueError):
                self.sched.add_request(req)
            return
        self.sched.add_request(req)
        self.live[rid] = req
        self.tokens[rid] = []
        self.prompt_lps[rid] = []

    def _never_fits(self, n: int) -> bool:
        cfg = self.cfg
        blocks = -(-(n + 1) // cfg["block_size"])
        return (n == 0 or n >= cfg["max_model_len"] or blocks > cfg["num_blocks"]
                or (not cfg["chunked"] and n > cfg["max_num_tokens"]))

    def abort(self) -> None:
        ids = self.rng.sample(sorted(self.live), min(len(self.live), 2)) + ["unknown"]
        for req in self.sched.abort_requests(ids):
            assert req.is_finished
            self._retire(req.request_id)

    def step(self) -> None:
        sched, cfg = self.sched, self.cfg
        out = sched.schedule()
        self.delivered += out.finished_request_ids
        assert out.seqs or not out.finished_request_ids
        assert out.num_batched_tokens <= cfg["max_num_tokens"]
        assert len(out.seqs) <= cfg["max_num_seqs"]
        assert len({s.request_id for s in out.seqs}) == len(out.seqs)
        for seq in out.seqs:
            req = seq.request
            end = seq.start_pos + seq.num_tokens
            assert seq.num_tokens > 0 and seq.start_pos == req.num_computed_tokens
            assert seq.token_ids == req.token_ids_slice(seq.start_pos, end)
            assert len(seq.block_ids) * cfg["block_size"] >= end
            assert seq.needs_sample == (end == req.num_tokens)
        self.check_books()
        for o in sched.update_from_output(out, self.sim.execute(out)):
            self.apply(o)
        self.check_books()

    def apply(self, o) -> None:
        rid = o.request_id
        assert rid not in self.finished, "output after finish"
        self.tokens[rid] += o.new_token_ids
        self.prompt_lps[rid] += o.prompt_logprobs or []
        if o.finished:
            req = self.live[rid]
            assert self.tokens[rid] == req.output_token_ids
            self.check_finish(req, o.finish_reason, o.stop_reason)
            self._retire(rid)

    def _retire(self, rid: str) -> None:
        req = self.live.pop(rid)
        if req.sampling_params.prompt_logprobs is not None and req.output_token_ids:
            expected = [None] + [{p: 0.0} for p in range(1, req.num_prompt_tokens)]
            assert self.prompt_lps[rid] == expected
        self.finished.add(rid)

    def check_finish(self, req: Request, reason: str, stop_reason) -> None:
        params, last = req.sampling_params, req.output_token_ids[-1]
        limit = min(self.cfg["max_model_len"], self.cfg["num_blocks"] * self.cfg["block_size"] + 1)
        if reason == "stop":
            assert req.num_output_tokens >= params.min_tokens
            if stop_reason is None:
                assert last in req.eos_token_ids and not params.ignore_eos
            else:
                assert stop_reason == last and last in params.stop_token_ids
        else:
            assert reason == "length"
            assert req.num_output_tokens == params.max_tokens or req.num_tokens == limit

    # ---- invariants ----------------------------------------------------------------------
    def check_books(self) -> None:
        sched, kv = self.sched, self.sched.kv
        pool = kv.pool
        assert sched.num_running <= self.cfg["max_num_seqs"]
        assert sched.num_running + sched.num_waiting == len(sched.requests) == len(self.live)
        holders: dict[int, int] = {}
        for rid, table in kv._tables.items():
            req = sched.requests[rid]
            assert req in sched.running
            assert len(table) == len(set(table))
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for req in sched.requests.values():
            if req not in sched.running:
                assert req.num_computed_tokens == 0 and not kv.get_block_ids(req.request_id)
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == holders.get(b, 0)
            if holders.get(b, 0) > 1:
                assert pool.block_hash[b] is not None, "shared block must be a cached one"
        assert kv.num_free_blocks == pool.num_blocks - len(holders)
        for h, b in pool._cached.items():
            assert pool.block_hash[b] == h

    def drain(self) -> None:
        for _ in range(3000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests() and not self.live
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.num_total_blocks
        assert all(c == 0 for c in kv.pool.ref_cnt)
        assert not kv._tables and not kv._hashes and not kv._pending_stats
        assert not self.sched._plp_received and not self.sched._plp_emitted
        pending = self.delivered + self.sched._finished_ids
        assert sorted(pending) == sorted(self.finished)  # each finished id reported once


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_operations_leak_nothing(name):
    totals = {"preemptions": 0, "hits": 0, "finished": 0}
    for seed in range(3):
        fz = Fuzz(seed * 7919 + len(name), CONFIGS[name])
        fz.random_operations(1200)
        if seed == 2:  # also end with everything aborted at once
            for req in fz.sched.abort_requests(list(fz.live)):
                fz._retire(req.request_id)
        fz.drain()
        totals["preemptions"] += fz.sched.num_preemptions
        totals["hits"] += fz.sched.kv.prefix_cache_hits
        totals["finished"] += len(fz.finished)
    assert totals["preemptions"] > 0 and totals["finished"] > 100
    assert (totals["hits"] > 0) == CONFIGS[name]["prefix"]
