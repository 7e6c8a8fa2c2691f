"""The batch layout the LoRA kernels read: rows grouped by adapter slot, cut into tiles.

Built with numpy on the host from each token's slot (-1: no adapter), then copied to the device
once. The rows are sorted by slot (a gather, not a copy of the activations); each tile holds up
to `block_m` rows of one slot, so a tile multiplies by one adapter's matrices with tensor cores.
A prefill chunk is one long run of one slot (segmented); a decode batch is many short runs
(gathered). The tile count has a bound that depends only on the token count and the number of
slots, so a CUDA graph captured for a token count replays any mix of adapters: unused tiles
carry slot -1 and return at once.

Packed int32 layout for T tokens and M = max_tiles(T, num_slots) tiles:
[sorted row ids: T | token slots: T | tile slot: M | tile first sorted row: M | tile rows: M].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def block_m_for(num_tokens: int) -> int:
    """Rows per tile: 16 (tensor-core minimum) for decode-sized batches, 64 for prefill."""
    return 16 if num_tokens <= 128 else 64


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """Tiles a batch of num_tokens can need: one per block_m rows, plus one partial tile per
    slot present (at most num_slots, at most one per token)."""
    bm = block_m_for(num_tokens)
    return -(-num_tokens // bm) + min(num_tokens, num_slots)


def packed_size(num_tokens: int, num_slots: int) -> int:
    return 2 * num_tokens + 3 * max_tiles(num_tokens, num_slots)


def pack_meta(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """The packed layout (module docstring) of one batch; token_slots int, -1 = no adapter."""
    slots = np.asarray(token_slots, dtype=np.int32)
    t = len(slots)
    m = max_tiles(t, num_slots)
    bm = block_m_for(t)
    out = np.empty(packed_size(t, num_slots), dtype=np.int32)
    order = np.argsort(slots, kind="stable").astype(np.int32)
    out[:t] = order
    out[t : 2 * t] = slots
    tile_slot, tile_start, tile_len = out[2 * t : 2 * t + m], out[2 * t + m : 2 * t + 2 * m], \
        out[2 * t + 2 * m :]
    tile_slot.fill(-1)
    tile_start.fill(0)
    tile_len.fill(0)
    sorted_slots = slots[order]
    # Runs of one slot in sorted order: [starts[i], ends[i]) holds slot run_slot[i].
    change = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = np.concatenate(([0], change)) if t else np.zeros(0, dtype=np.int64)
    ends = np.concatenate((change, [t])) if t else np.zeros(0, dtype=np.int64)
    n = 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        slot = int(sorted_slots[start])
        if slot < 0:
            continue
        if slot >= num_slots:
            raise ValueError(f"LoRA slot {slot} is outside the {num_slots} slots")
        firsts = np.arange(start, end, bm)
        k = len(firsts)
        tile_slot[n : n + k] = slot
        tile_start[n : n + k] = firsts
        tile_len[n : n + k] = np.minimum(bm, end - firsts)
        n += k
    return out


@dataclass
class LoRAMeta:
    """Device views of one packed layout; block_m and num_tiles are fixed host ints."""

    sorted_ids: torch.Tensor  # int32 [T]: row ids, grouped by slot
    token_slots: torch.Tensor  # int32 [T]: each row's slot, -1 none
    tile_slot: torch.Tensor  # int32 [M]
    tile_start: torch.Tensor  # int32 [M]: index into sorted_ids
    tile_len: torch.Tensor  # int32 [M]
    block_m: int
    num_tokens: int

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def meta_views(packed: torch.Tensor, num_tokens: int, num_slots: int) -> LoRAMeta:
    """LoRAMeta over a device tensor holding (at least) the packed layout for num_tokens."""
    t, m = num_tokens, max_tiles(num_tokens, num_slots)
    return LoRAMeta(sorted_ids=packed[:t], token_slots=packed[t : 2 * t],
                    tile_slot=packed[2 * t : 2 * t + m], tile_start=packed[2 * t + m : 2 * t + 2 * m],
                    tile_len=packed[2 * t + 2 * m : 2 * t + 3 * m], block_m=block_m_for(t),
                    num_tokens=t)
