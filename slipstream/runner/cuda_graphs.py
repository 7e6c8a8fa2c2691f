"""CUDA graphs for pure-decode steps: captured once per padded batch size at start-up.

A decode step is the same sequence of kernels whatever the tokens, so it is recorded once per
batch size and replayed: one launch instead of hundreds. Inputs live in static buffers that each
step overwrites; a batch is padded up to the nearest captured size (padding rows write no KV).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable

import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.runner.input_batch import HostBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch_size (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


def _pdl_enabled(device: torch.device) -> bool:
    try:
        from slipstream.kernels.runtime import pdl  # Triton: optional
    except ImportError:  # no Triton
        return False
    return pdl.enabled(device)


class DecodeGraphs:
    """Static decode buffers plus one captured graph (model + logits) per batch size."""

    def __init__(self, model, kv_caches, device: torch.device, max_batch_size: int,
                 max_blocks_per_seq: int, max_seq_len: int):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        # Greedy choice + next-step inputs on the device: fused Triton kernels on CUDA.
        self._advance, self._argmax = _greedy_ops(device)
        self.sizes = capture_sizes(max_batch_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        b = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(b, **i64)
        self.positions = torch.zeros(b, **i64)
        self.slot_mapping = torch.full((b,), -1, **i64)
        self.seq_lens = torch.ones(b, **i32)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), **i32)
        self.query_start_loc = torch.arange(b + 1, **i32)
        # Two pinned staging buffers, used in turn: a step may be staged while the copy of the
        # one before it is still queued behind GPU work (pipelined decode).
        self._hosts = [_staging_buffer(5 * b + b * max_blocks_per_seq, device) for _ in range(2)]
        self._host_copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=b, num_tokens=b, query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b], max_query_len=1, max_seq_len=self.max_seq_len)

    def _forward(self, b: int, float32: bool = True) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
        return self.model.compute_logits(hidden, float32)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        mem_before = torch.cuda.memory_allocated(self.device)
        logits_out = None
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            for _ in range(2):  # warm-up: autotuning and lazy init happen outside capture
                warm = self._forward(b, float32=False)
            if logits_out is None:
                logits_out = torch.empty(warm.shape, dtype=torch.float32, device=warm.device)
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), no_gc():
                # Every graph writes its logits into one shared buffer: a graph's own output
                # would stay allocated per batch size (17 GB over sizes up to 1024 for a
                # 128k vocabulary), memory the KV budget never counted. The copy is also the
                # float32 conversion (one pass over the logits instead of two).
                logits_out[:b].copy_(self._forward(b, float32=False))
            self.logits[b] = logits_out[:b]
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s..%s) in %.1f s, %.0f MiB; "
                    "programmatic dependent launch %s", len(self.graphs), self.sizes[0],
                    self.sizes[-1], time.perf_counter() - start,
                    (torch.cuda.memory_allocated(self.device) - mem_before) / 2**20,
                    "on" if _pdl_enabled(self.device) else "off")

    def padded_size(self, num_seqs: int) -> int | None:
        for b in self.sizes:
            if b >= num_seqs:
                return b
        return None

    def run(self, hb: HostBatch, feed: tuple[torch.Tensor, list[int]] | None = None
            ) -> torch.Tensor:
        """Replay for a pure-decode host batch; returns logits [num_seqs, vocab]. feed: as in
        run_steps."""
        n = len(hb.input_ids)
        b = self._stage(hb, feed[1] if feed is not None else None)
        if feed is not None:
            self._feed_inputs(n, *feed)
        return self._step(b)[:n]

    def run_steps(self, hb: HostBatch, num_steps: int, block_size: int,
                  feed: tuple[torch.Tensor, list[int]] | None = None,
                  sample: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """`num_steps` greedy decode steps back to back, each argmax fed in as the next input.
        sample: logits [n, vocab] -> token ids [n] on the device, called once a step in step
        order (the sampler, for batches with requests that are not greedy) instead of argmax.

        Nothing waits for the host between steps: positions, sequence lengths and slots advance
        on the device (the block tables already cover every step). Returns token ids
        [num_steps, num_seqs] on the device; reading them is the one sync.

        feed: (tokens [R], rows) from an earlier step whose tokens the host has not read yet:
        row i of this batch takes its input token from tokens[rows[i]] (hb.input_ids there
        are placeholders), or keeps hb's where rows[i] is -1.
        """
        n = len(hb.input_ids)
        b = self._stage(hb, feed[1] if feed is not None else None)
        if feed is not None:
            self._feed_inputs(n, *feed)
        tokens = torch.empty((num_steps, n), dtype=torch.int64, device=self.device)
        for step in range(num_steps):
            logits = self._step(b)[:n]
            if sample is not None:
                tokens[step].copy_(sample(logits))
                if step + 1 < num_steps:
                    advance_with_tokens(tokens[step], self.input_ids, self.positions,
                                        self.seq_lens, self.slot_mapping, self.block_tables,
                                        block_size)
            elif step + 1 < num_steps:
                self._advance(logits, tokens[step], self.input_ids, self.positions, self.seq_lens,
                              self.slot_mapping, self.block_tables, block_size)
            else:
                self._argmax(logits, out=tokens[step])
        return tokens

    def warm_up_greedy(self, block_size: int) -> None:
        """Run the multi-step argmax + advance once on dummy logits, so its kernels compile at
        start-up rather than on the first multi-step decode. It advances row 0 of the static
        buffers, which every run stages afresh."""
        vocab = self.model.config.vocab_size
        logits = torch.zeros((1, vocab), dtype=torch.float32, device=self.device)
        tokens = torch.empty(1, dtype=torch.int64, device=self.device)
        self._advance(logits, tokens, self.input_ids, self.positions, self.seq_lens,
                      self.slot_mapping, self.block_tables, block_size)
        self._argmax(logits, out=tokens)

    def _feed_inputs(self, n: int, tokens: torch.Tensor, rows: list[int]) -> None:
        """input_ids[i] = tokens[rows[i]] where rows[i] >= 0 (rows staged as _feed_rows)."""
        if rows == list(range(n)):
            self.input_ids[:n].copy_(tokens[:n])
            return
        idx = self._feed_rows[:n]
        fed = tokens.index_select(0, idx.clamp(min=0))
        self.input_ids[:n].copy_(torch.where(idx >= 0, fed, self.input_ids[:n]))

    def _step(self, b: int) -> torch.Tensor:
        """Logits of all b (padded) rows: a graph replay, or an eager forward when not captured."""
        if b in self.graphs:
            self.graphs[b].replay()
            return self.logits[b]
        with torch.inference_mode():
            return self._forward(b)

    def _stage(self, hb: HostBatch, feed_rows: list[int] | None = None) -> int:
        """Copy a host batch into the static buffers (padded to a captured size); returns it.
        feed_rows (see run_steps) go to the device too, as self._feed_rows."""
        n = len(hb.input_ids)
        b = self.padded_size(n)
        width = hb.block_tables.shape[1]
        # One pinned staging buffer, one copy per field, all non-blocking.
        turn, self._turn = self._turn, self._turn ^ 1
        if self._host_copied[turn] is not None:
            self._host_copied[turn].synchronize()  # its last copy has left the buffer
        host_buf = self._hosts[turn]
        host = host_buf.numpy()
        host[0:n] = hb.input_ids
        host[b : b + n] = hb.positions
        host[2 * b : 2 * b + n] = hb.slot_mapping
        host[3 * b : 3 * b + n] = hb.seq_lens
        if n < b:  # padding rows: write nowhere, attend to one (ignored) position
            host[n:b] = 0
            host[b + n : 2 * b] = 0
            host[2 * b + n : 3 * b] = -1
            host[3 * b + n : 4 * b] = 1
        if feed_rows is not None:
            host[4 * b : 4 * b + n] = feed_rows
        tables = host[5 * b : 5 * b + b * width].reshape(b, width)
        tables[:n] = hb.block_tables
        tables[n:] = 0
        staged = host_buf[: 5 * b + b * width].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._host_copied[turn] = torch.cuda.Event()
            self._host_copied[turn].record()
        self.input_ids[:b].copy_(staged[0:b])
        self.positions[:b].copy_(staged[b : 2 * b])
        self.slot_mapping[:b].copy_(staged[2 * b : 3 * b])
        self.seq_lens[:b].copy_(staged[3 * b : 4 * b])
        self._feed_rows = staged[4 * b : 5 * b]
        self.block_tables[:b, :width].copy_(staged[5 * b :].view(b, width))
        return b


def _staging_buffer(numel: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros((numel,), dtype=torch.int64)
    return buf.pin_memory() if device.type == "cuda" else buf


def _greedy_ops(device: torch.device):
    """(argmax_and_advance, argmax_rows) for the device, resolved once."""
    if device.type == "cuda":
        from slipstream.kernels.sampling.greedy import argmax_and_advance, argmax_rows  # Triton

        return argmax_and_advance, argmax_rows
    return argmax_and_advance_reference, lambda x, out: torch.argmax(x, dim=-1, out=out)


def argmax_and_advance_reference(logits, out, input_ids, positions, seq_lens, slot_mapping,
                                 block_tables, block_size: int) -> None:
    """Twin of kernels.sampling.greedy.argmax_and_advance: out = argmax of each logits row, fed back as
    the next input (input_ids), one position on (positions, seq_lens +1, slot_mapping)."""
    torch.argmax(logits, dim=-1, out=out)
    advance_with_tokens(out, input_ids, positions, seq_lens, slot_mapping, block_tables,
                        block_size)


def advance_with_tokens(tokens, input_ids, positions, seq_lens, slot_mapping, block_tables,
                        block_size: int) -> None:
    """tokens [n] become the next inputs of the first n rows, one position on (positions,
    seq_lens +1, slot_mapping), in torch ops on the device."""
    n = tokens.shape[0]
    input_ids[:n].copy_(tokens)
    positions[:n].add_(1)
    seq_lens[:n].add_(1)
    pos = positions[:n]
    rows = torch.arange(n, device=tokens.device)
    block = block_tables[rows, pos // block_size].to(torch.int64)
    slot_mapping[:n].copy_(block * block_size + pos % block_size)


@contextlib.contextmanager
def no_gc():
    """No garbage collection while a graph is captured: collecting an earlier engine's objects
    there could free its pinned buffers, and the host allocator's event calls are not allowed
    during a capture (they invalidate it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
