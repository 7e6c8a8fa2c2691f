"""Triton attention backend: for pure decode batches one kernel rotates q and k, writes the new
K/V into the paged cache and attends (kernels/attention/paged.py, RopeInput); other batches run
the fused rotary + cache-write kernel, then paged attention, like the reference backend.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.attention.reference import ReferenceAttentionBackend, attention_options
from slipstream.kernels.attention.paged import RopeInput, paged_attention


class TritonAttentionBackend(ReferenceAttentionBackend):
    """Same forward as ReferenceAttentionBackend; decode batches save the rotary launch."""

    name = "triton"

    def __init__(self, ops: SimpleNamespace | None = None):
        super().__init__(ops)
        # The fused decode kernel is Triton's own: with the reference op table (the float32
        # oracle runs) every batch takes the composed reference path.
        self.fuse_decode = getattr(self.ops, "name", None) == "triton"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, *, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None, l2_prefetch: torch.Tensor | None = None,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:
        # The fused decode kernel rotates whole heads: a partial-rotary table takes the
        # composed path (ops.rotary_and_cache_write rotates its first dims with torch ops).
        whole_heads = cos_sin_cache.shape[-1] == q.shape[-1]
        if not (self.fuse_decode and q.is_cuda and meta.max_query_len <= 1 and whole_heads):
            return super().forward(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta,
                                   scale, k_scale=k_scale, v_scale=v_scale,
                                   sliding_window=sliding_window, logit_softcap=logit_softcap)
        return paged_attention(q, k_cache, v_cache, meta, scale, k_scale=k_scale,
                               v_scale=v_scale, rope=RopeInput(k, v, positions, cos_sin_cache),
                               l2_prefetch=l2_prefetch,
                               **attention_options(sliding_window, logit_softcap))
