"""Random add / step / abort / preempt sequences with speculative drafts, against the scheduler
and the paging simulator (tests/scheduler/paged_sim.py).

Each step gives running requests random draft tokens (right with probability 0.6), the
simulator verifies them through the block tables, and rejected drafts' slots are rolled back.
Every slot read back must hold the true prefix's value, so a rejected token left in a block
that is read later (by its request, or by another through the prefix cache) fails; at the end
no block is leaked and every ref count is zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slipstream.scheduler.output import RunnerOutput, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
from paged_sim import PagedSim, chain, true_value  # noqa: E402
from test_scheduler_fuzz import CONFIGS, Fuzz  # noqa: E402


class SpecSim(PagedSim):
    """Verifies draft tokens like the sampler: a row per fed token from the last known one on,
    drafts accepted while each equals the token sampled at its position."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ro = RunnerOutput()
        for seq in out.seqs:
            if not seq.num_spec_tokens:
                ro_one = super().execute(SchedulerOutput(seqs=[seq]))
                ro.sampled_token_ids.update(ro_one.sampled_token_ids)
                ro.logprobs.update(ro_one.logprobs)
                ro.prompt_logprobs.update(ro_one.prompt_logprobs)
                continue
            values = self._forward_rows(seq)
            req = seq.request
            known_end = seq.start_pos + seq.num_tokens - seq.num_spec_tokens
            assert values[0] == true_value(req.token_ids_slice(0, known_end)), req.request_id
            targets = [self.sample(v) for v in values]
            drafts = seq.token_ids[-seq.num_spec_tokens :]
            n = 0
            while n < len(drafts) and drafts[n] == targets[n]:
                n += 1
            ro.sampled_token_ids[seq.request_id] = targets[: n + 1]
            if req.sampling_params.prompt_logprobs is not None:
                entries = self._prompt_logprobs(seq)
                if entries:
                    ro.prompt_logprobs[seq.request_id] = entries
        return ro

    def _forward_rows(self, seq) -> list[int]:
        """Values after the last known token and after each draft (their slots written)."""
        bs, pos = self.block_size, seq.start_pos
        value = 0 if pos == 0 else self._read(seq.block_ids, pos - 1)
        values = []
        for i, token in enumerate(seq.token_ids):
            value = chain(value, token)
            self.cache[seq.block_ids[pos // bs]][pos % bs] = value
            pos += 1
            if i >= seq.num_tokens - seq.num_spec_tokens - 1:
                values.append(value)
        return values


class SpecFuzz(Fuzz):
    def __init__(self, seed: int, cfg: dict):
        super().__init__(seed, cfg)
        self.sim = SpecSim(cfg["num_blocks"], cfg["block_size"], vocab=24)
        self.num_verified = 0

    def propose(self) -> None:
        for req in self.sched.running:
            if req.num_tokens - req.num_computed_tokens != 1 or self.rng.random() < 0.2:
                continue
            value, drafts = true_value(req.all_token_ids), []
            for _ in range(self.rng.randint(1, 4)):
                token = self.sim.sample(value)
                drafts.append(token if self.rng.random() < 0.6 else (token + 1) % 24)
                value = chain(value, token)
            req.spec_token_ids = drafts

    def step(self) -> None:
        self.propose()
        sched, cfg = self.sched, self.cfg
        out = sched.schedule()
        self.delivered += out.finished_request_ids
        assert out.num_batched_tokens <= cfg["max_num_tokens"]
        for seq in out.seqs:
            req, known = seq.request, seq.num_tokens - seq.num_spec_tokens
            assert seq.token_ids[:known] == req.token_ids_slice(seq.start_pos, seq.start_pos + known)
            assert len(seq.block_ids) * cfg["block_size"] >= seq.start_pos + seq.num_tokens
            if seq.num_spec_tokens:
                self.num_verified += 1
                assert known == 1 and seq.needs_sample
                room = min(
                    self.sched.max_seq_len - req.num_tokens,
                    req.sampling_params.max_tokens - req.num_output_tokens,
                )
                assert seq.num_spec_tokens <= room - 1
        self.check_books()
        for o in sched.update_from_output(out, self.sim.execute(out)):
            self.apply(o)
        self.check_books()
        for req in sched.running:  # rollback: no block past the known tokens' is kept
            table = sched.kv.get_block_ids(req.request_id)
            assert len(table) <= max(
                -(-req.num_tokens // cfg["block_size"]),
                -(-(req.num_computed_tokens + 1) // cfg["block_size"]),
            )


@pytest.mark.parametrize("name", ["prefix-chunked", "no-chunk-small-cache", "big-blocks"])
def test_random_speculation_leaks_nothing(name):
    totals = {"preemptions": 0, "hits": 0, "verified": 0}
    for seed in range(2):
        fz = SpecFuzz(seed * 104729 + len(name), CONFIGS[name])
        fz.random_operations(800)
        fz.drain()
        totals["preemptions"] += fz.sched.num_preemptions
        totals["hits"] += fz.sched.kv.prefix_cache_hits
        totals["verified"] += fz.num_verified
    assert totals["preemptions"] > 0 and totals["verified"] > 100 and totals["hits"] > 0
