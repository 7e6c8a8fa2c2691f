"""Attention backend interface and the per-step metadata every backend reads.

KV cache layout (per layer): k_cache and v_cache, each [num_blocks, block_size, num_kv_heads,
head_dim]. Token t of a sequence lives in block block_table[t // block_size], row t % block_size;
its flat slot is block_id * block_size + t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Flat, padding-free batch of num_seqs sequences, num_tokens query tokens in all.

    Sequence s owns query rows query_start_loc[s] : query_start_loc[s+1]. Its K/V length after
    this step's writes is seq_lens[s]; its query tokens sit at the last query_len positions, so
    query row i of s is at absolute position seq_lens[s] - query_len_s + i (causal mask).
    """

    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32 (pad entries: 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64 (-1: do not write, e.g. padding)
    max_query_len: int
    max_seq_len: int
    # Host copies for the reference path (avoid device->host syncs there).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Speculative draft trees (speculative/tree.py): [num_tokens] int64, per query row the bit
    # set of the chunk positions (bit j: seq_len - query_len + j) it may see besides the
    # cached prefix, -1 for ordinary causal rows; None: every row is causal.
    tree_mask: torch.Tensor | None = None
    tree_mask_cpu: list[int] | None = None

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
