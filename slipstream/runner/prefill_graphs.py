"""CUDA graphs for short prefill steps: captured once per padded token count at start-up.

An eager forward of a short prompt launches ~20 kernels a layer from Python, and the host issues
them slower than the GPU runs them (a 128-token Llama-3.1-8B prefill spends several times its GPU
time issuing kernels). A flat batch of at most `max_seqs` sequences and
`max_tokens` tokens is therefore replayed from a graph captured for the next token count up:
a new prompt alone, or beside the decodes of running requests (a step that would otherwise
stall each of them for the eager forward).

The padded batch keeps every row finite: the tokens past the real ones form one extra sequence
(slots -1: it writes no KV; it reads block 0), and the unused sequence rows are empty (no query
tokens). Metadata the kernels size themselves by on the host (token and sequence counts, the
longest context) is fixed at capture; everything that varies lives in device buffers.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.runner.cuda_graphs import no_gc
from slipstream.runner.input_batch import HostBatch, put_fed_tokens

logger = logging.getLogger(__name__)

# Sequences a captured step takes at most (one more row holds the padding): each costs a row of
# logits ([rows, vocab] float32, 0.5 MiB at a 128k vocabulary) and of block table.
MAX_SEQS = 64
_MIN_TOKENS = 16


def prefill_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, ... up to max_tokens (a power of two at most)."""
    sizes, t = [], _MIN_TOKENS
    while t <= max_tokens:
        sizes.append(t)
        t *= 2
    return sizes


class PrefillGraphs:
    """Static flat-batch buffers plus one captured graph (model + sampled rows' logits) per size.

    pool: a CUDA graph memory pool to share (the decode graphs'); graphs never run concurrently.
    trees: capture with a draft-tree mask (tree_mask), so steps verifying draft trees replay too.
    keep_hidden: the forward also writes every row's final hidden state into `hidden`.
    """

    def __init__(self, model, kv_caches, device: torch.device, max_tokens: int,
                 max_blocks_per_seq: int, max_seq_len: int, max_seqs: int = MAX_SEQS, pool=None,
                 max_logits_rows: int | None = None, trees: bool = False,
                 keep_hidden: bool = False):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_seqs = min(max_seqs, MAX_SEQS)
        # Rows of logits a step returns: one per sampled seq, more when speculative decoding
        # verifies draft tokens (k + 1 rows a seq).
        self.max_rows = max(self.max_seqs, max_logits_rows or 0)
        self.sizes = prefill_sizes(max_tokens)
        if not self.sizes or self.sizes[-1] > max_seq_len:
            # The padding sequence spans up to the largest size: its block-table row must too.
            raise ValueError(f"prefill graphs for {self.sizes or 'no'} tokens need "
                             f"max_tokens >= {_MIN_TOKENS} and at most max_seq_len={max_seq_len}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.pool = pool
        t, s = self.sizes[-1], self.max_seqs + 1
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.slot_mapping = torch.full((t,), -1, **i64)
        self.query_start_loc = torch.zeros(s + 1, **i32)
        self.seq_lens = torch.zeros(s, **i32)
        self.block_tables = torch.zeros((s, max_blocks_per_seq), **i32)
        self.logits_indices = torch.zeros(self.max_rows, **i64)
        # Every graph is captured with the TREE variant of the attention kernel when the engine
        # can draft trees (lookahead, Medusa, speculative_token_tree): nearly every step of such
        # an engine verifies a tree, and the variant costs a plain step only one int64 load a
        # row (-1: causal) and the causal mask on the chunk's tiles, which a second set of
        # graphs for tree steps would save at twice the capture time.
        self.tree_mask = torch.full((t,), -1, **i64) if trees else None
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # [max tokens, hidden] once the model ran
        self._host = torch.zeros(3 * t + (s + 1) + s + s * max_blocks_per_seq + self.max_rows
                                 + (t if trees else 0),
                                 dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def _meta(self, t: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=self.max_seqs + 1, num_tokens=t, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:t], max_query_len=t, max_seq_len=self.max_seq_len,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:t])

    def _forward(self, t: int, float32: bool = False) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(t))
        if self.keep_hidden:
            if self.hidden is None:  # allocated by the first (warm-up) forward, before capture
                self.hidden = torch.empty((self.sizes[-1], hidden.shape[-1]), dtype=hidden.dtype,
                                          device=self.device)
            self.hidden[:t].copy_(hidden)
        return self.model.compute_logits(hidden[self.logits_indices], float32)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        mem_before = torch.cuda.memory_allocated(self.device)
        # Warm-up and capture run on a batch of padding only: it writes no KV.
        self._stage_padding_only(self.sizes[-1])
        for t in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._stage_padding_only(t)
            for _ in range(2):  # compiles, GEMM tuning and lazy init happen outside capture
                warm = self._forward(t)
            if self.logits is None:
                self.logits = torch.empty(warm.shape, dtype=torch.float32, device=self.device)
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), no_gc():
                self.logits.copy_(self._forward(t))  # also the float32 conversion
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[t] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d prefill CUDA graphs (%s..%s tokens, up to %d sequences) in "
                    "%.1f s, %.0f MiB", len(self.graphs), self.sizes[0], self.sizes[-1],
                    self.max_seqs,
                    time.perf_counter() - start,
                    (torch.cuda.memory_allocated(self.device) - mem_before) / 2**20)

    def padded_size(self, num_tokens: int) -> int | None:
        for t in self.sizes:
            if t >= num_tokens:
                return t
        return None

    def accepts(self, hb: HostBatch) -> bool:
        """Whether a captured graph can run this host batch."""
        return ((hb.tree_mask is None or self.tree_mask is not None)
                and len(hb.seq_lens) <= self.max_seqs and len(hb.logits_indices) <= self.max_rows
                and self.padded_size(len(hb.input_ids)) is not None
                and hb.block_tables.shape[1] <= self.max_blocks_per_seq
                and int(hb.seq_lens.max()) <= self.max_seq_len)

    def run(self, hb: HostBatch, feed: tuple[torch.Tensor, list[int]] | None = None
            ) -> torch.Tensor:
        """Replay for the host batch (accepts(hb) must hold); returns the logits of its sampled
        rows [len(hb.logits_indices), vocab], float32. feed: (tokens, rows) as in
        DecodeGraphs.run_steps: seq i's last input token is tokens[rows[i]] where rows[i] >= 0."""
        t = self._stage(hb)
        put_fed_tokens(self.input_ids, hb, feed)
        k = len(hb.logits_indices)
        if t not in self.graphs:  # not captured (the CPU): the same padded batch, eagerly
            with torch.inference_mode():
                return self._forward(t, float32=True)[:k]
        self.graphs[t].replay()
        self.replays += 1
        return self.logits[:k]

    def hidden_rows(self, n: int) -> torch.Tensor:
        """The last run's final hidden states of its n real rows, [n, hidden]: a copy, since
        the next step overwrites the buffer while a proposer may still hold rows of it."""
        return self.hidden[:n].clone()

    def _stage_padding_only(self, t: int) -> None:
        """A batch of t padding tokens and no real sequence (warm-up and capture)."""
        empty = np.zeros(0, dtype=np.int64)
        hb = HostBatch(empty, empty, empty, np.zeros(1, dtype=np.int32),
                       np.zeros(0, dtype=np.int32),
                       np.zeros((0, self.max_blocks_per_seq), dtype=np.int32), empty, [])
        self._stage(hb, t)

    def _stage(self, hb: HostBatch, t: int | None = None) -> int:
        """Copy a host batch into the static buffers, padded to t tokens (default: the next
        captured size); returns t. One pinned staging buffer, one copy."""
        n, s = len(hb.input_ids), len(hb.seq_lens)
        t = t or self.padded_size(n)
        rows, width = self.max_seqs + 1, hb.block_tables.shape[1]
        if self._host_copied is not None:
            self._host_copied.synchronize()  # the previous step's copy has left the buffer
        host = self._host.numpy()
        ids, pos, slots = host[0:t], host[t : 2 * t], host[2 * t : 3 * t]
        ids[:n], pos[:n], slots[:n] = hb.input_ids, hb.positions, hb.slot_mapping
        ids[n:], slots[n:] = 0, -1
        pos[n:] = np.arange(t - n)  # the padding sequence's own positions 0..t-n-1
        o = 3 * t
        qsl = host[o : o + rows + 1]
        qsl[: s + 1] = hb.query_start_loc
        qsl[s + 1 :] = t  # the padding sequence holds rows n..t-1; the rest are empty
        o += rows + 1
        lens = host[o : o + rows]
        lens[:s] = hb.seq_lens
        lens[s] = t - n
        lens[s + 1 :] = 0
        o += rows
        # Only the columns this batch uses are copied (max_blocks_per_seq follows max_model_len,
        # up to thousands): columns past them keep earlier steps' block ids, which no real
        # sequence reads and the padding sequence may (any cached block: finite values).
        width = max(width, 1)
        tables = host[o : o + rows * width].reshape(rows, width)
        tables[:] = 0
        tables[:s] = hb.block_tables
        o += rows * width
        k = len(hb.logits_indices)
        logits_idx = host[o : o + self.max_rows]
        logits_idx[:k] = hb.logits_indices
        logits_idx[k:] = 0
        o += self.max_rows
        if self.tree_mask is not None:
            mask = host[o : o + t]
            mask[:n] = -1 if hb.tree_mask is None else hb.tree_mask
            mask[n:] = -1
            o += t
        staged = self._host[:o].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._host_copied = torch.cuda.Event()
            self._host_copied.record()
        self.input_ids[:t].copy_(staged[0:t])
        self.positions[:t].copy_(staged[t : 2 * t])
        self.slot_mapping[:t].copy_(staged[2 * t : 3 * t])
        o = 3 * t
        self.query_start_loc.copy_(staged[o : o + rows + 1])
        o += rows + 1
        self.seq_lens.copy_(staged[o : o + rows])
        o += rows
        self.block_tables[:, :width].copy_(staged[o : o + rows * width].view(rows, width))
        o += rows * width
        self.logits_indices.copy_(staged[o : o + self.max_rows])
        o += self.max_rows
        if self.tree_mask is not None:
            self.tree_mask[:t].copy_(staged[o : o + t])
        return t
