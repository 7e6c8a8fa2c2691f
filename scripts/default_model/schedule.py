"""Warmup-stable-decay learning-rate schedule whose decay starts when validation stalls.

The corpus is small, so how many epochs pay off is not known in advance: the rate stays at its
peak until the validation loss stops improving (or the step / time / epoch limit nears), then
decays linearly to zero over a fixed fraction of the steps taken so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WsdSchedule:
    peak_lr: float
    warmup_steps: int
    max_total: int  # hard limit on steps: explicit, or from the epoch cap and the time budget
    decay_frac: float = 0.25
    patience: int | None = 4  # evaluations without improvement; None: never stop early
    min_improvement: float = 1e-3  # relative
    decay_start: int | None = None
    total: int | None = None
    decay_reason: str = ""
    best_val: float = math.inf
    stale: int = 0

    @property
    def max_stable(self) -> int:
        """The last step at which decay can start and still end within max_total."""
        return max(1, math.floor(self.max_total / (1 + self.decay_frac)))

    def lr(self, step: int) -> float:
        """Learning rate for 0-based step `step`."""
        warmup = min(self.warmup_steps, max(1, self.max_stable // 5))
        if step < warmup:
            return self.peak_lr * (step + 1) / warmup
        if self.decay_start is None or step < self.decay_start:
            return self.peak_lr
        assert self.total is not None
        frac = (step - self.decay_start) / max(1, self.total - self.decay_start)
        return self.peak_lr * max(0.0, 1.0 - frac)

    def start_decay(self, step: int, reason: str) -> None:
        if self.decay_start is not None:
            return
        length = max(1, math.ceil(self.decay_frac * step))
        self.decay_start, self.decay_reason = step, reason
        self.total = max(step + 1, min(self.max_total, step + length))
        if reason == "step limit":
            self.total = max(step + 1, self.max_total)

    def after_step(self, step: int) -> None:
        """Call with the number of steps done; starts the decay at the step limit."""
        if self.decay_start is None and step >= self.max_stable:
            self.start_decay(step, "step limit")

    def observe_validation(self, step: int, val_loss: float) -> None:
        """Start the decay once the validation loss has stalled for `patience` evaluations."""
        if val_loss < self.best_val * (1 - self.min_improvement):
            self.best_val, self.stale = val_loss, 0
            return
        self.stale += 1
        if self.patience is not None and self.stale >= self.patience:
            self.start_decay(step, "validation plateau")

    def finished(self, step: int) -> bool:
        return self.total is not None and step >= self.total
