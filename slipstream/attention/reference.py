"""Reference attention backend: rotary + paged KV write, then attention over the paged cache.

It composes two ops of the kernel table, so on the CPU it is the plain-PyTorch oracle; a
fused Triton backend implements the same `forward` signature.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.kernels import reference_ops


class ReferenceAttentionBackend:
    """forward(q [T,Hq,D], k/v [T,Hkv,D], ...) -> [T, Hq, D]; writes k (rotated), v to the cache."""

    name = "reference"

    def __init__(self, ops: SimpleNamespace | None = None):
        self.ops = ops or reference_ops()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        q, _ = self.ops.rotary_and_cache_write(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        return self.ops.paged_attention(q, k_cache, v_cache, meta, scale)
