"""The model runner of one distributed rank: ModelRunner, where a pipeline stage without the
LM head (compute_logits is None) still runs the warm-up, profiling and prompt-logprob passes
that its peers run, minus the logits."""
from __future__ import annotations

import torch

from slipstream.runner.model_runner import ModelRunner
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
