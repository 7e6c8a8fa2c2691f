"""Plain-PyTorch twins of the batched LoRA kernels (kernels/lora/triton_lora.py): the CPU path
and the test oracle.

One LoRA-carrying linear layer keeps, per device slot, A [S, n_sub * R, K] (the A matrices of
its fused sub-projections stacked: q, k, v or gate, up) and B [S, N, R] (each sub-projection's
B in its rows of the output, scaling folded in). Output shard j reads columns [j R, (j + 1) R)
of the shrunk activations: y[:, shard j] += (x A_j^T) B_j^T.
"""
from __future__ import annotations

import torch

from slipstream.kernels.lora.meta import LoRAMeta


def _slot_rows(meta: LoRAMeta) -> list[tuple[int, torch.Tensor]]:
    slots = meta.token_slots.long()
    return [(s, (slots == s).nonzero().squeeze(1)) for s in torch.unique(slots).tolist() if s >= 0]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    """h [T, n_sub * R] float32 = x A[slot]^T per row; rows without an adapter are 0."""
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, rows in _slot_rows(meta):
        h[rows] = x[rows].float() @ a[slot].float().T
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, meta: LoRAMeta,
                shard_starts: tuple[int, ...]) -> torch.Tensor:
    """y[:, shard j] += h[:, j R:(j + 1) R] B[slot][shard j]^T per row with an adapter, in
    place; returns y. shard_starts: first output column of each shard (0 first)."""
    rank = b.shape[2]
    bounds = (*shard_starts, b.shape[1])
    for slot, rows in _slot_rows(meta):
        for j in range(len(shard_starts)):
            lo, hi = bounds[j], bounds[j + 1]
            delta = h[rows, j * rank : (j + 1) * rank] @ b[slot, lo:hi].float().T
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
    return y


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: LoRAMeta, shard_starts: tuple[int, ...], h=None) -> torch.Tensor:
    """y += each row's adapter delta, in place: lora_expand(y, lora_shrink(x, a), b) (h: the
    Triton kernels' shrink buffer, unused here)."""
    return lora_expand(y, lora_shrink(x, a, meta), b, meta, shard_starts)
