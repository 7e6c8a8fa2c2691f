"""The scheduler fuzz across both KV tiers: a small device cache with a host tier behind it, and
swap / auto / recompute preemption. The paging simulator makes every queued block copy, so a
restore from the wrong host block, a copy queued after the write it must precede, or a host
block holding two hashes changes the K/V read back; at the end nothing is leaked in either tier.
"""
from __future__ import annotations

import pytest
from paged_sim import PagedSim
from test_scheduler_fuzz import Fuzz

from slipstream.config import CacheConfig, SchedulerConfig
from slipstream.scheduler.scheduler import Scheduler

TIERED = {
    "swap": dict(block_size=4, num_blocks=14, max_num_tokens=24, max_num_seqs=6, max_model_len=48,
                 prefix=True, chunked=True, host_blocks=24, mode="swap"),
    "auto-tiny-host": dict(block_size=2, num_blocks=16, max_num_tokens=20, max_num_seqs=5,
                           max_model_len=30, prefix=True, chunked=False, host_blocks=6,
                           mode="auto"),
    "recompute": dict(block_size=4, num_blocks=12, max_num_tokens=16, max_num_seqs=4,
                      max_model_len=40, prefix=True, chunked=True, host_blocks=40,
                      mode="recompute"),
}


class TieredSim(PagedSim):
    """PagedSim plus host blocks: applies the KV manager's queued copies before each step."""

    def __init__(self, kv, cfg: dict):
        super().__init__(cfg["num_blocks"], cfg["block_size"], vocab=24)
        self.kv = kv
        self.host = [[None] * cfg["block_size"] for _ in range(cfg["host_blocks"])]
        self.copies = {"out": 0, "in": 0}

    def execute(self, out):
        for kind, src, dst in self.kv.take_transfers():
            source, target = (self.cache, self.host) if kind == "out" else (self.host, self.cache)
            target[dst] = list(source[src])
            self.copies[kind] += 1
        return super().execute(out)


class TieredFuzz(Fuzz):
    def __init__(self, seed: int, cfg: dict):
        super().__init__(seed, cfg)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=cfg["max_num_seqs"], max_num_tokens=cfg["max_num_tokens"],
                            max_model_len=cfg["max_model_len"],
                            enable_chunked_prefill=cfg["chunked"], preemption_mode=cfg["mode"]),
            CacheConfig(block_size=cfg["block_size"], num_blocks=cfg["num_blocks"],
                        enable_prefix_caching=True, num_host_blocks=cfg["host_blocks"]))
        self.sim = TieredSim(self.sched.kv, cfg)

    def check_books(self) -> None:
        super().check_books()
        self.sched.kv.host.check()
        assert not self.sched.kv.host._pinned


@pytest.mark.parametrize("name", sorted(TIERED))
def test_random_operations_across_tiers(name):
    totals = {"preemptions": 0, "host_hits": 0, "in": 0, "out": 0}
    for seed in range(2):
        fz = TieredFuzz(seed * 104729 + len(name), TIERED[name])
        fz.random_operations(1000)
        fz.drain()
        kv = fz.sched.kv
        assert not kv._host_hits
        totals["preemptions"] += fz.sched.num_preemptions
        totals["host_hits"] += kv.host_hits
        totals["in"] += fz.sim.copies["in"]
        totals["out"] += fz.sim.copies["out"]
    assert totals["preemptions"] > 0 and totals["host_hits"] > 0
    assert totals["in"] * TIERED[name]["block_size"] == totals["host_hits"]
    assert totals["out"] > 0
