"""Start-up phases of an engine: read weights, quantize, tune, profile memory, warm up, capture.

Tuning and quantization happen inside other phases (a GEMV tuner runs the first time the warm-up
meets a shape; a layer is quantized as its last tensor arrives), so the code doing them counts
its own seconds (`counting`), and each phase reports its time less what those counters gained.
"""
from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# Seconds spent inside nested work, by phase name; only ever grows.
_NESTED: dict[str, float] = {"quantize": 0.0, "tune": 0.0}
# Set while `slipstream build` starts its engine: compiled kernels are also written there.
BUILD_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("slipstream_build_dir",
                                                                         default=None)
PHASES = ("read_weights", "quantize", "tune", "profile_memory", "warm_up", "capture_graphs")


def freeze_startup_objects() -> int:
    """Put every object alive after start-up (modules, the model, compiled kernels: hundreds
    of thousands) out of the garbage collector's reach, and return how many. A full collection
    walks every tracked object: over these it takes 650 ms in a tiny CPU engine process, a
    stall on the TTFT and ITL of every request in flight. Serving rarely triggers one (the
    step loop's objects are freed by reference counting), so this is insurance against the
    rare one. Only for processes slipstream owns (the engine process, the server)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def counting(name: str) -> Iterator[None]:
    """Count the enclosed seconds as nested phase `name` ("quantize" or "tune"); a nested
    `counting` of the same name inside it is not counted twice."""
    start = time.perf_counter()
    before = _NESTED[name]
    try:
        yield
    finally:
        inner = _NESTED[name] - before
        _NESTED[name] = before + inner + max(time.perf_counter() - start - inner, 0.0)


class StartupPhases:
    """Seconds per phase of one engine's start-up, nested work moved to its own phase."""

    def __init__(self, sync=None) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._sync = sync or (lambda: None)  # wait for the device: a phase ends with its work
        self._start = time.perf_counter()
        self.total: float | None = None  # set by end()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = dict(_NESTED)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            nested = {k: _NESTED[k] - before[k] for k in _NESTED}
            for k, v in nested.items():
                self.seconds[k] += v
            self.seconds[name] += max(elapsed - sum(nested.values()), 0.0)

    def end(self) -> None:
        """Start-up is over: the total is the time since creation."""
        self.total = time.perf_counter() - self._start

    def as_dict(self) -> dict[str, float]:
        """{phase: seconds, ..., "total": seconds from creation to end()}, in milliseconds."""
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        total = self.total if self.total is not None else time.perf_counter() - self._start
        out["total"] = round(total, 3)
        return out

    def log(self, prefix: str = "start-up") -> None:
        d = self.as_dict()
        logger.info("%s %.1f s: %s", prefix, d["total"], ", ".join(
            f"{k.replace('_', ' ')} {d[k]:.2f} s" for k in PHASES))


def device_sync(device: str):
    """A callable that waits for `device`'s queued work (a no-op off CUDA)."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    return lambda: torch.cuda.synchronize(torch.device(device))


class KernelCaches:
    """On CUDA, reuses what earlier starts measured and compiled: a built engine's tuning table,
    Triton cache and NVRTC binaries (build/), then the persistent cache directory
    (kernels/runtime/tuning_cache.py); `save()` adds this start's new choices to the latter."""

    def __init__(self, config) -> None:
        self.path = None
        if not str(config.device).startswith("cuda"):
            return
        import torch

        from slipstream.kernels.cuda import launch
        from slipstream.kernels.runtime import tuning_cache

        device = torch.device(config.device)
        root = tuning_cache.cache_dir()
        binary_dirs = [] if root is None else [root / "nvrtc"]
        if config.load_format == "engine":
            from slipstream.build.engine_dir import use_engine_kernels

            binary_dirs.insert(0, use_engine_kernels(config.model_path))
        if BUILD_DIR.get() is not None:  # a build compiles every kernel into the engine
            binary_dirs = [BUILD_DIR.get() / "nvrtc"]
        launch.set_binary_dirs(binary_dirs)
        if config.load_format == "engine":  # the build's measurements come first
            tuning_cache.load_file(Path(config.model_path) / "tuning.json")
        self.path = tuning_cache.cache_file(device)
        if self.path is not None:
            tuning_cache.load_file(self.path)
        self._known = tuning_cache.num_entries()

    def save(self) -> None:
        if self.path is None:
            return
        from slipstream.kernels.runtime import tuning_cache

        if tuning_cache.num_entries() > self._known:
            tuning_cache.save_file(self.path)
