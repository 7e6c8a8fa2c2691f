"""HostKVCopies: the host KV tier's memory and its block copies, batched.

The host tier is one tensor, block-major: [host blocks, layers, K/V, block_size, heads,
head_dim], so a block of every layer is one contiguous span of host memory (pinned on
CUDA). A step's copies go in batches whatever their number:

- offloads ("out"): one gather per layer and K/V of the device blocks into a device staging
  buffer (ordered on the compute stream before the forward that may overwrite them), then
  one device-to-host copy per run of consecutive host blocks, on a side stream: it overlaps
  the forward, and a later restore waits for it on the device, never on the host.
- restores ("in"): one host-to-device copy per run of consecutive host blocks into a staging
  buffer, then one scatter per layer and K/V into the device blocks, before the forward.

`measure_copy_rate` and `measure_matmul_rate` time this device for the tier's cost model
(kv_cache/tier_cost.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from slipstream.kv_cache.host_tier import Transfer
from slipstream.runner.input_batch import to_device

# Staging buffers are cut into batches of at most this many bytes.
_STAGING_BYTES = 64 << 20


class HostKVCopies:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int):
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.kv_caches = kv_caches
        self.block_shape = tuple(k0.shape[1:])
        pin = self.device.type == "cuda"
        self.host = torch.zeros(
            (num_blocks, len(kv_caches), 2, *self.block_shape), dtype=k0.dtype, pin_memory=pin
        )
        self.block_bytes = self.host[0].numel() * self.host.element_size()
        self.max_batch = max(1, _STAGING_BYTES // self.block_bytes)
        self._side = torch.cuda.Stream(self.device) if pin else None
        self._offloads_done: torch.cuda.Event | None = None

    def apply(self, transfers: list[Transfer]) -> None:
        """The transfers, in effect in their order: batches of offloads then restores, cut
        where an offload would read a device block an earlier restore writes, or overwrite a
        host block an earlier restore reads."""
        outs: list[tuple[int, int]] = []
        ins: list[tuple[int, int]] = []
        in_hosts: set[int] = set()
        in_blocks: set[int] = set()
        for kind, src, dst in transfers:
            if (dst in in_hosts or src in in_blocks) if kind == "out" else dst in in_blocks:
                self._flush(outs, ins)
                outs, ins, in_hosts, in_blocks = [], [], set(), set()
            if kind == "out":
                outs.append((src, dst))
            else:
                ins.append((src, dst))
                in_hosts.add(src)
                in_blocks.add(dst)
        self._flush(outs, ins)

    def _flush(self, outs: list[tuple[int, int]], ins: list[tuple[int, int]]) -> None:
        for i in range(0, len(outs), self.max_batch):
            self._offload(outs[i : i + self.max_batch])
        for i in range(0, len(ins), self.max_batch):
            self._restore(ins[i : i + self.max_batch])

    def _offload(self, pairs: list[tuple[int, int]]) -> None:
        src = _indices([d for d, _ in pairs], self.device)
        staging = torch.empty((len(pairs), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            staging[:, layer, 0] = k.index_select(0, src)
            staging[:, layer, 1] = v.index_select(0, src)
        if self._side is None:
            for start, first, count in _runs([h for _, h in pairs]):
                self.host[first : first + count].copy_(staging[start : start + count])
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for start, first, count in _runs([h for _, h in pairs]):
                self.host[first : first + count].copy_(staging[start : start + count], non_blocking=True)
            staging.record_stream(self._side)
            self._offloads_done = torch.cuda.Event()
            self._offloads_done.record(self._side)

    def _restore(self, pairs: list[tuple[int, int]]) -> None:
        non_blocking = self._side is not None
        if self._offloads_done is not None:  # a restore may read a block still being written
            torch.cuda.current_stream(self.device).wait_event(self._offloads_done)
        staging = torch.empty((len(pairs), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
        for start, first, count in _runs([h for h, _ in pairs]):
            staging[start : start + count].copy_(self.host[first : first + count], non_blocking=non_blocking)
        dst = _indices([d for _, d in pairs], self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, dst, staging[:, layer, 0])
            v.index_copy_(0, dst, staging[:, layer, 1])


def _indices(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device without a host sync (pinned, non-blocking on CUDA)."""
    return to_device(np.asarray(ids, dtype=np.int64), device)


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in the batch, first host block, count) for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, h, 1))
    return runs


def _elapsed(device: torch.device, fn, repeat: int = 3) -> float:
    """Best of `repeat` timings of fn() (every stream drained), in seconds, after a warm-up."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_rate(copies: HostKVCopies) -> float:
    """Bytes per second of a batched restore and offload (the slower), a staging buffer's worth
    of host blocks or all of them."""
    n = min(copies.max_batch, copies.host.shape[0], copies.kv_caches[0][0].shape[0])
    pairs = [(i, i) for i in range(n)]
    seconds = max(
        _elapsed(copies.device, lambda: copies._restore(pairs)),
        _elapsed(copies.device, lambda: copies._offload(pairs)),
    )
    for k, v in copies.kv_caches:  # start-up: the blocks hold nothing yet
        k[:n].zero_()
        v[:n].zero_()
    copies.host[:n].zero_()
    return n * copies.block_bytes / max(seconds, 1e-9)


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, hidden: int) -> float:
    """FLOPs per second of prefill-sized matmuls ([tokens, hidden] x [hidden, 4 * hidden]),
    run back to back so that launch and sync costs do not count: the rate a large prefill's
    linear layers reach."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 8192
    if device.type != "cuda":  # a rate: a smaller problem measures it well enough on a CPU
        tokens, hidden = 64, min(hidden, 1024)
    a = torch.randn(tokens, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
    flops = 2 * tokens * hidden * 4 * hidden
    repeat = max(1, min(16, int(2e12 // flops))) if device.type == "cuda" else 1

    def run():
        for _ in range(repeat):
            torch.mm(a, b)

    return repeat * flops / max(_elapsed(device, run), 1e-9)
