"""Flat, padding-free batch for one step, built with numpy on the host, then moved once.

All scheduled tokens are concatenated (prefill chunks and decodes side by side); per-sequence
offsets, lengths and block tables go into AttentionMetadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.scheduler.output import ScheduledSeq
from slipstream.speculative import tree


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [S] int64: the row of each sampled seq's last token (with drafts: its last k + 1 rows)
    logits_indices: torch.Tensor
    sample_seq_indices: list[int]  # index into the step's seqs, one per logits row
    query_start_loc_cpu: list[int]  # [num_seqs + 1]


@dataclass
class HostBatch:
    """numpy arrays of one step (host side), before the copy to the device."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, max_blocks] (pad 0)
    logits_indices: np.ndarray  # int64 [num sampled (+ draft tokens verified)]
    sample_seq_indices: list[int]
    # Draft trees: per token the attention bit set (AttentionMetadata.tree_mask); None: none.
    tree_mask: np.ndarray | None = None


class BlockTableRows:
    """Each request's block table kept as a numpy row across steps, so a step's table is one
    gather: only rows whose block list changed since the last step are converted (a decode
    adds a block every block_size tokens). A change is found by comparing the list with the
    copy the row was made from (a list compare runs in C), so any edit counts: growth, a
    trim, blocks released behind a sliding window, a new table after a preemption."""

    def __init__(self, rows: int = 64, width: int = 16):
        self._table = np.zeros((rows, width), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._held: list[list[int] | None] = [None] * rows  # each row's block list (a copy)
        self._free = list(range(rows - 1, -1, -1))

    def forget(self, request_ids: list[str]) -> None:
        """Give back the rows of requests that left the engine."""
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._held[row] = None
                self._free.append(row)

    def gather(self, seqs: list[ScheduledSeq], width: int) -> np.ndarray:
        """[len(seqs), width] int32: row i holds seqs[i].block_ids[:width], padded with 0."""
        rows = []
        held, row_of = self._held, self._row_of
        for s in seqs:
            ids = s.block_ids
            row = row_of.get(s.request.request_id)
            if row is None:
                row = self._take_row(s.request.request_id)
            if held[row] != ids:
                self._store(row, ids)
            rows.append(row)
        if width > self._table.shape[1]:
            self._widen(width)
        return self._table[rows, :width]  # a copy: later steps rewrite the rows

    def _take_row(self, request_id: str) -> int:
        if not self._free:
            n = len(self._held)
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._held += [None] * n
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._row_of[request_id] = self._free.pop()
        return row

    def _widen(self, width: int) -> None:
        self._table = np.pad(self._table, ((0, 0), (0, width - self._table.shape[1])))

    def _store(self, row: int, ids: list[int]) -> None:
        if len(ids) > self._table.shape[1]:
            self._widen(max(len(ids), 2 * self._table.shape[1]))
        self._table[row, : len(ids)] = ids
        self._table[row, len(ids) :] = 0
        self._held[row] = list(ids)


def build_host_batch(seqs: list[ScheduledSeq], block_size: int,
                     max_blocks_per_seq: int | None = None,
                     tables: BlockTableRows | None = None) -> HostBatch:
    """numpy arrays for `seqs`; max_blocks_per_seq pads the block table to a fixed width.
    tables: the block tables kept from earlier steps (the runner's), else built afresh."""
    if not seqs:
        raise ValueError("cannot build a batch of zero sequences")
    num_seqs = len(seqs)
    num_tokens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
    if (num_tokens < 1).any():
        raise ValueError("every scheduled sequence needs at least one token")
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=query_start_loc[1:])
    seq_lens = (starts + num_tokens).astype(np.int32)
    input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64,
                            count=int(query_start_loc[-1]))
    # positions: start_pos + offset inside the seq's chunk, for every token at once
    seq_of_token = np.repeat(np.arange(len(seqs)), num_tokens)
    positions = np.arange(len(input_ids), dtype=np.int64) - query_start_loc[seq_of_token] \
        + starts[seq_of_token]
    block_tables = _block_tables(seqs, seq_lens, block_size, max_blocks_per_seq, tables)
    block_of_token = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    slot_mapping = block_of_token * block_size + positions % block_size
    tree_mask = None
    if any(s.spec_parents for s in seqs):  # stored in chunk order, rotated at tree depth
        tree_mask = _tree_positions(seqs, query_start_loc, positions)
    sample_seq_indices = [i for i, s in enumerate(seqs) if s.needs_sample]
    logits_indices = query_start_loc[1:][sample_seq_indices].astype(np.int64) - 1
    if any(s.num_spec_tokens for s in seqs):
        logits_indices = _spec_logits_indices(seqs, sample_seq_indices, logits_indices)
    return HostBatch(input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                     block_tables, logits_indices, sample_seq_indices, tree_mask)


def _tree_positions(seqs: list[ScheduledSeq], query_start_loc: np.ndarray,
                    positions: np.ndarray) -> np.ndarray:
    """Draft trees (speculative/tree.py): set each tree node's position to its depth past the
    last known token (in place) and return every token's attention bit set (-1: causal)."""
    mask = np.full(len(positions), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        if not s.spec_parents:
            continue
        root = int(query_start_loc[i + 1]) - s.num_spec_tokens - 1
        if root != int(query_start_loc[i]):
            raise ValueError(f"request {s.request_id}: a draft tree follows one known token")
        base = int(positions[root])
        positions[root + 1 : root + 1 + s.num_spec_tokens] = base + np.array(
            tree.depths(s.spec_parents), dtype=np.int64)
        mask[root : root + 1 + s.num_spec_tokens] = tree.row_masks(s.spec_parents)
    return mask


def _spec_logits_indices(seqs: list[ScheduledSeq], sampled: list[int],
                         last_rows: np.ndarray) -> np.ndarray:
    """Speculative decoding: a seq verifying k draft tokens gets the logits of its last k + 1
    rows (in order), every other sampled seq those of its last row."""
    parts = [np.arange(row - seqs[i].num_spec_tokens, row + 1, dtype=np.int64)
             for i, row in zip(sampled, last_rows.tolist())]
    return np.concatenate(parts)


def _block_tables(seqs: list[ScheduledSeq], seq_lens: np.ndarray, block_size: int,
                  width: int | None, tables: BlockTableRows | None = None) -> np.ndarray:
    needed = (seq_lens + block_size - 1) // block_size
    have = np.fromiter((len(s.block_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    short = np.flatnonzero(have < needed)
    if len(short):
        s = seqs[short[0]]
        raise ValueError(f"request {s.request_id}: {len(s.block_ids)} blocks cannot hold "
                         f"{s.start_pos + s.num_tokens} tokens (block_size {block_size})")
    if width is not None and width < needed.max():
        raise ValueError(f"max_blocks_per_seq={width} is below the {needed.max()} blocks needed")
    width = width or int(have.max())
    if tables is not None:
        return tables.gather(seqs, width)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    if have.max() <= width:  # every table fits: one flat copy in row order
        flat = np.fromiter(chain.from_iterable(s.block_ids for s in seqs), dtype=np.int32,
                           count=int(have.sum()))
        table[np.arange(width) < have[:, None]] = flat
        return table
    for i, s in enumerate(seqs):
        ids = s.block_ids[:width]
        table[i, : len(ids)] = ids
    return table


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor; through pinned memory and non-blocking on CUDA."""
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def prepare_inputs(seqs: list[ScheduledSeq], block_size: int, device: torch.device,
                   max_blocks_per_seq: int | None = None) -> ModelInputs:
    """The step's model inputs and attention metadata on `device`."""
    return inputs_from_host_batch(build_host_batch(seqs, block_size, max_blocks_per_seq), device)


def inputs_from_host_batch(hb: HostBatch, device: torch.device) -> ModelInputs:
    """Copy a host batch to `device` and wrap it with attention metadata."""
    qsl_cpu = hb.query_start_loc.tolist()
    lens_cpu = hb.seq_lens.tolist()
    meta = AttentionMetadata(
        num_seqs=len(hb.seq_lens),
        num_tokens=len(hb.input_ids),
        query_start_loc=to_device(hb.query_start_loc, device),
        seq_lens=to_device(hb.seq_lens, device),
        block_tables=to_device(hb.block_tables, device),
        slot_mapping=to_device(hb.slot_mapping, device),
        max_query_len=int(np.diff(hb.query_start_loc).max()),
        max_seq_len=max(lens_cpu),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=lens_cpu,
        tree_mask=None if hb.tree_mask is None else to_device(hb.tree_mask, device),
        tree_mask_cpu=None if hb.tree_mask is None else hb.tree_mask.tolist(),
    )
    return ModelInputs(
        input_ids=to_device(hb.input_ids, device),
        positions=to_device(hb.positions, device),
        meta=meta,
        logits_indices=to_device(hb.logits_indices, device),
        sample_seq_indices=hb.sample_seq_indices,
        query_start_loc_cpu=qsl_cpu,
    )


def put_fed_tokens(input_ids: torch.Tensor, hb: HostBatch,
                   feed: tuple[torch.Tensor, list[int]] | None) -> None:
    """Input tokens still on the device (async scheduling): seq i's last input token (row
    query_start_loc[i + 1] - 1 of input_ids) becomes tokens[rows[i]] where rows[i] >= 0."""
    if feed is None:
        return
    tokens, rows = feed
    fed = [i for i, r in enumerate(rows) if r >= 0]
    if fed:
        at = to_device(hb.query_start_loc[np.array(fed) + 1].astype(np.int64) - 1,
                       input_ids.device)
        src = to_device(np.array([rows[i] for i in fed], dtype=np.int64), input_ids.device)
        input_ids.index_copy_(0, at, tokens.index_select(0, src))
