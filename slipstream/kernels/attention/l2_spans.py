"""Weights pulled into L2 while the GPU's memory bus would otherwise sit idle.

A batch-1 decode layer spends ~10 us in attention, which reads ~1 MB of K/V and leaves most
SMs and nearly all of the HBM bandwidth unused, and then runs the o and gate/up GEMVs, which
read the layer's next 25-200 MB of weights. Spare programs of the attention launch
(kernels/attention/paged.py) ask the TMA unit to prefetch those weights into L2
(`cp.async.bulk.prefetch.L2`, sm_90+: one
instruction a span, fire-and-forget, nothing comes back to the SM), so the GEMVs that follow
find part of their bytes in L2 instead of HBM. A prefetch is a hint: it changes no result.

The host side builds, once per layer before the decode graphs are captured, a table of spans
(start address, bytes), each at most SPAN_BYTES, covering the tensors to prefetch in order
up to a byte budget (budget_bytes). The addresses are fixed because weights never
move after loading, so the table is safe inside a CUDA graph. The device side is
kernels/attention/l2_prefetch.py; this module needs no Triton.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

# The budget: half the GPU's L2 (25 MB on the H100 / H200), which leaves room for the GEMVs' own
# streaming reads (a budget near the whole L2 was slower than none). The gain is mostly
# o_proj's: a one-row int4 GEMV is instruction- and latency-bound, barely faster from L2.
L2_SHARE = 0.5
# Weight formats whose decode step runs faster without the prefetch: the one-row int4 GEMVs
# request their next tiles early enough that the prefetch's extra HBM traffic costs them more
# than o_proj gains.
NO_PREFETCH_METHODS = frozenset({"int4_awq"})
SPAN_BYTES = 128 * 1024  # one program's share: split over its threads, a bulk prefetch each
_ALIGN = 16  # cp.async.bulk: 16-byte aligned addresses, sizes a multiple of 16


def budget_bytes(device: torch.device | None = None, method: str | None = None) -> int:
    """L2_SHARE of the device's L2; 0 off CUDA, below compute capability 9.0 (the bulk
    prefetch is sm_90's) and for a quantization method in NO_PREFETCH_METHODS."""
    if device is None or device.type != "cuda" or not supported(device):
        return 0
    if method in NO_PREFETCH_METHODS:
        return 0
    return int(L2_SHARE * torch.cuda.get_device_properties(device).L2_cache_size)


def supported(device: torch.device) -> bool:
    """Whether the device runs cp.async.bulk.prefetch (CUDA, compute capability 9.0+)."""
    return device.type == "cuda" and _sm90(device.index if device.index is not None
                                           else torch.cuda.current_device())


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, bytes) of each tensor's memory, aligned inward to 16 bytes (a hint may skip the
    ragged edges; it must not reach outside the tensor)."""
    out = []
    for t in tensors:
        if t.numel() == 0 or not t.is_contiguous():
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        start = -(-start // _ALIGN) * _ALIGN
        end = end // _ALIGN * _ALIGN
        if end > start:
            out.append((start, end - start))
    return out


def span_table(groups: list[list[torch.Tensor]], budget: int,
               device: torch.device) -> torch.Tensor | None:
    """int64 [n, 2] (address, bytes) spans of at most SPAN_BYTES over `groups` in order, at most
    `budget` bytes in all, or None when nothing fits. The first group's tensors are taken in
    full while the budget lasts; in a group that does not fit, each tensor gets the same
    leading fraction, so every part a kernel reads together (weights, scales, zeros) is warm
    for the same rows."""
    spans: list[tuple[int, int]] = []
    left = budget
    for group in groups:
        regions = _regions(group)
        total = sum(n for _, n in regions)
        if total == 0 or left < _ALIGN:
            continue
        share = min(1.0, left / total)
        for start, n in regions:
            take = int(n * share) // _ALIGN * _ALIGN
            for off in range(0, take, SPAN_BYTES):
                spans.append((start + off, min(SPAN_BYTES, take - off)))
            left -= take
    if not spans:
        return None
    return torch.tensor(spans, dtype=torch.int64, device=device)


def chunk_bytes(num_warps: int) -> int:
    """Bytes each thread of a num_warps program prefetches of one span (a multiple of 16)."""
    per_thread = -(-SPAN_BYTES // (32 * num_warps))
    return -(-per_thread // _ALIGN) * _ALIGN
