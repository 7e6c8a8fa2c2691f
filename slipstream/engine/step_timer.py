"""Per-step time breakdown (schedule, prepare, forward, sample, update), behind a flag.

Set SLIPSTREAM_STEP_TIMING=1 (envs.STEP_TIMING) or pass enabled=True. Phases on the GPU are
synchronised before each reading, so timing perturbs the run: use it to find where time goes,
not to benchmark.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from slipstream import envs


class StepTimer:
    def __init__(self, device: str = "cpu", enabled: bool | None = None):
        if enabled is None:
            enabled = envs.STEP_TIMING.get()
        self.enabled = enabled
        self._cuda = str(device).startswith("cuda")
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start
            self.counts[name] += 1

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def summary(self) -> dict[str, dict[str, float]]:
        """{phase: {"total_s", "mean_ms", "count"}}."""
        return {name: {"total_s": total, "mean_ms": 1e3 * total / max(1, self.counts[name]),
                       "count": self.counts[name]} for name, total in self.totals.items()}

    def table(self) -> str:
        rows = [f"{'phase':<10} {'count':>8} {'mean ms':>9} {'total s':>9}"]
        for name, s in self.summary().items():
            rows.append(f"{name:<10} {s['count']:>8} {s['mean_ms']:>9.3f} {s['total_s']:>9.3f}")
        return "\n".join(rows)
