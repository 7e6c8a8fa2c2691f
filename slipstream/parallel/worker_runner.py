"""The model runner of one distributed rank: ModelRunner, where a pipeline stage without the
LM head (compute_logits is None) still runs the warm-up, profiling and prompt-logprob passes
that its peers run, minus the logits, and where a multi-step decode with tensor parallelism
feeds every rank the first rank's sampled tokens."""
from __future__ import annotations

import torch

from slipstream.parallel.state import rank_info, tp_broadcast_first
from slipstream.runner.model_runner import ModelRunner
from slipstream.sampling.sampler import Sampler
from slipstream.scheduler.output import SchedulerOutput


class WorkerRunner(ModelRunner):
    @property
    def has_head(self) -> bool:
        return getattr(self.model, "lm_head", True) is not None

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput):
        """Logits on the last stage; zeros [S, 1] elsewhere (the warm-up's and the memory
        profile's callers only need a tensor)."""
        logits, inputs = super().forward_logits(sched)
        if logits is None:
            logits = torch.zeros(len(inputs.sample_seq_indices), 1, device=self.device)
        return logits, inputs

    def _prompt_logprobs(self, seq, hidden, row0):
        if not self.has_head:
            return []
        return super()._prompt_logprobs(seq, hidden, row0)

    def _get_sampler(self):
        if self._sampler is None and rank_info().tp_size > 1:
            self._sampler = _AgreeingSampler(seed=self.config.seed)
        return super()._get_sampler()


class _AgreeingSampler(Sampler):
    """With tensor parallelism every rank holds the same gathered logits, but a sampled token
    also depends on the generator state, which differs between ranks where no seed was given
    (each process seeds itself). Each rank feeds its sampled tokens back as the next input in
    a multi-step decode, so the ranks take the first rank's tokens: one broadcast of [seqs]
    ids a step. Greedy rows need none (argmax of identical logits), but a batch that samples
    any row broadcasts it whole."""

    def sample_on_device(self, logits, requests):
        return tp_broadcast_first(super().sample_on_device(logits, requests).contiguous())
