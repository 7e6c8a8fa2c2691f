"""A stand-in for the model runner that really pages: it writes a value per position into
block slots through each sequence's block table and samples from what it reads back.

Each slot holds chain(value at pos - 1, token): the K/V of a position depends on its whole
prefix, as in a transformer. A wrong block table, a bad prefix hit or an overwritten shared block
therefore changes the value read back, which `execute` checks against the true token sequence.
"""
from __future__ import annotations

from slipstream.scheduler.output import RunnerOutput, SchedulerOutput


def chain(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFFFFFFFFFF


def true_value(token_ids: list[int]) -> int:
    value = 0
    for token in token_ids:
        value = chain(value, token)
    return value


class PagedSim:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 32, check: bool = True):
        self.block_size = block_size
        self.vocab = vocab
        self.check = check
        self.cache = [[None] * block_size for _ in range(num_blocks)]

    def sample(self, value: int) -> int:
        return value % self.vocab

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ro = RunnerOutput()
        # In order: a block shared in this very step was written by an earlier sequence.
        for seq in out.seqs:
            value = self._forward(seq)
            req = seq.request
            if self.check:
                end = seq.start_pos + seq.num_tokens
                assert value == true_value(req.token_ids_slice(0, end)), req.request_id
            rid = seq.request_id
            if seq.needs_sample:
                token = self.sample(value)
                ro.sampled_token_ids[rid] = [token]
                ro.logprobs[rid] = [{token: -0.5}]
            if req.sampling_params.prompt_logprobs is not None:
                entries = self._prompt_logprobs(seq)
                if entries:
                    ro.prompt_logprobs[rid] = entries
        return ro

    def _forward(self, seq) -> int:
        bs = self.block_size
        pos = seq.start_pos
        value = 0 if pos == 0 else self._read(seq.block_ids, pos - 1)
        for token in seq.token_ids:
            value = chain(value, token)
            self.cache[seq.block_ids[pos // bs]][pos % bs] = value
            pos += 1
        return value

    def _read(self, block_ids: list[int], pos: int) -> int:
        value = self.cache[block_ids[pos // self.block_size]][pos % self.block_size]
        assert value is not None, "read a slot that was never written"
        return value

    @staticmethod
    def _prompt_logprobs(seq) -> list:
        """One entry per prompt position this chunk covers ({position: 0.0}; position 0: None)."""
        end = min(seq.start_pos + seq.num_tokens, seq.request.num_prompt_tokens)
        return [None if p == 0 else {p: 0.0} for p in range(seq.start_pos, end)]
