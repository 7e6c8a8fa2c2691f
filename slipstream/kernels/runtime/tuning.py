"""Timing for the start-up kernel tuner: as the decode CUDA graph will run the kernel.

A candidate is timed inside a CUDA graph of back-to-back calls (no Python launch cost between
them, like the decode graph), cycling through enough copies of the weights that none is served
from L2 (in a real step every layer's weights are different bytes). The GPU is spun up to its
working clock first, and the median of several replays is kept: single do_bench runs at start-up
picked different configs from run to run. Bounded by graph replay: each timing costs a capture
and a few replays per candidate, which is why the tuners keep their candidate lists short.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream.engine.startup import counting
from slipstream.kernels.runtime import pdl

L2_FLUSH_BYTES = 128 << 20  # over twice the H100/H200 L2 (50 MB)
_SPUN_UP: set[int | None] = set()


def weight_copies(tensors: Sequence[torch.Tensor], min_bytes: int = L2_FLUSH_BYTES,
                  max_copies: int = 64) -> list[tuple[torch.Tensor, ...]]:
    """The tensors plus clones, so that cycling through them touches at least min_bytes."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n = min(max(1, -(-min_bytes // max(nbytes, 1))), max_copies)
    return [tuple(tensors)] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def spin_up(device: torch.device, ms: float = 200.0) -> None:
    """Keep the GPU busy for about `ms` once per device, so tuning runs at the working clock."""
    if device.index in _SPUN_UP:
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    elapsed = 0.0
    while elapsed < ms:
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        elapsed += start.elapsed_time(end)
    _SPUN_UP.add(device.index)


def graph_time_us(call: Callable[[tuple[torch.Tensor, ...]], Any],
                  arg_sets: list[tuple[torch.Tensor, ...]], min_calls: int = 24,
                  repeats: int = 7, idle_before_us: float = 0.0) -> float:
    """Median microseconds per call of `call(args)` replayed in a CUDA graph over arg_sets.

    idle_before_us > 0: each call follows a kernel that spins that long (pdl.spin), and the
    result is the time the call adds beyond it (what a GEMV costs after attention, whose idle
    DRAM a GEMV launched under PDL can already use; the start-up tuners time back to back)."""
    with counting("tune"):  # the start-up log's "tune" phase
        return _graph_time_us(call, arg_sets, min_calls, repeats, idle_before_us)


def _graph_time_us(call: Callable[[tuple[torch.Tensor, ...]], Any],
                   arg_sets: list[tuple[torch.Tensor, ...]], min_calls: int, repeats: int,
                   idle_before_us: float) -> float:
    if idle_before_us <= 0:
        return _replay_us(call, arg_sets, min_calls, repeats)
    device = arg_sets[0][0].device
    both = _replay_us(lambda a: (pdl.spin(device, idle_before_us), call(a)), arg_sets, min_calls,
                      repeats)
    alone = _replay_us(lambda a: pdl.spin(device, idle_before_us), arg_sets, min_calls, repeats)
    return both - alone


def _replay_us(call: Callable[[tuple[torch.Tensor, ...]], Any],
               arg_sets: list[tuple[torch.Tensor, ...]], min_calls: int, repeats: int) -> float:
    device = arg_sets[0][0].device
    spin_up(device)
    calls = max(min_calls, len(arg_sets))
    call(arg_sets[0])  # compile outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(arg_sets[i % len(arg_sets)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)
