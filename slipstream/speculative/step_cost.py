"""The measured cost of a verifying step relative to a plain decode step, per batch-size bucket.

adaptive.choose_k needs how much more a step that verifies drafts costs than a plain decode step
of the same tokens. That depends on the dtype, the model's shape and the GPU (1.28x in bf16,
about 1.8x in float32 for the Llama-3.1-8B shape at batch 1), so the engine measures it: two
exponential moving averages of seconds per step, one for plain decode steps and one for
verifying steps, each keyed by a coarse batch-size bucket.

Both are brought to one weight read: a step of T tokens costs max(1, T / ridge_tokens) of them
(adaptive.py's model), and a plain step that ran n decode steps without the host (multi-step
decode) is n steps' worth. The ratio verify / plain is then the factor choose_k applies to a
verifying step, and stands in for 1 + SPECULATION_OVERHEAD once both averages of the bucket have
`min_samples` samples.
"""

from __future__ import annotations

import bisect

# Upper bounds of the batch-size buckets (1, 2-4, 5-16, 17-64); larger batches share the last.
BATCH_BUCKET_BOUNDS = (1, 4, 16, 64)
# Weight of a new step in an average, and the samples an average needs before it is used.
EMA_WEIGHT = 0.2
MIN_SAMPLES = 8


def batch_bucket(batch_size: int) -> int:
    """Index of the bucket holding batch_size (0: batch 1, ..., 4: 65 and more)."""
    return bisect.bisect_left(BATCH_BUCKET_BOUNDS, batch_size)


def bucket_label(bucket: int) -> str:
    bounds = BATCH_BUCKET_BOUNDS
    low = 1 if bucket == 0 else bounds[bucket - 1] + 1
    if bucket == len(bounds):
        return f"{low}+"
    return str(low) if low == bounds[bucket] else f"{low}-{bounds[bucket]}"


class Ema:
    """Exponential moving average that starts at its first sample."""

    def __init__(self, weight: float):
        self.weight = weight
        self.value = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value = x if self.count == 1 else self.value + self.weight * (x - self.value)


class StepCostEstimator:
    def __init__(self, ridge_tokens: int, weight: float = EMA_WEIGHT, min_samples: int = MIN_SAMPLES):
        self.ridge_tokens = ridge_tokens
        self.min_samples = min_samples
        n = len(BATCH_BUCKET_BOUNDS) + 1
        self.plain = [Ema(weight) for _ in range(n)]
        self.verify = [Ema(weight) for _ in range(n)]

    def _weight_reads(self, num_tokens: int) -> float:
        return max(1.0, num_tokens / self.ridge_tokens)

    def record_plain(self, batch_size: int, seconds: float, num_steps: int = 1) -> None:
        """A plain decode step of batch_size requests that emitted num_steps tokens each."""
        per_step = seconds / num_steps
        self.plain[batch_bucket(batch_size)].add(per_step / self._weight_reads(batch_size))

    def record_verify(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """A decode step of batch_size requests, some verifying drafts: num_tokens fed in all."""
        self.verify[batch_bucket(batch_size)].add(seconds / self._weight_reads(num_tokens))

    def cost_ratio(self, batch_size: int) -> float | None:
        """Cost of a verifying step over a plain one of the same tokens (at least 1), or None
        while either average of the bucket has fewer than min_samples samples."""
        b = batch_bucket(batch_size)
        plain, verify = self.plain[b], self.verify[b]
        if min(plain.count, verify.count) < self.min_samples or plain.value <= 0:
            return None
        # A verification cannot cost less than the plain step it extends: below 1 is noise.
        return max(1.0, verify.value / plain.value)

    def ratios(self) -> dict[str, float | None]:
        """The measured ratio per bucket label (None: not enough samples yet)."""
        return {
            bucket_label(b): self.cost_ratio(1 if b == 0 else BATCH_BUCKET_BOUNDS[b - 1] + 1)
            for b in range(len(self.plain))
        }
