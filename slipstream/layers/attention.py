"""Attention layer: picks the attention backend and runs it on one layer's paged KV cache.

It owns the layer's KV-cache scales (k_scale, v_scale: float32 scalars, real = stored * scale),
used when the cache is fp8 or int8; quantization/kv_cache.py fills them.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.attention.cpu_backend import CpuAttentionBackend
from slipstream.attention.reference import ReferenceAttentionBackend

logger = logging.getLogger(__name__)


def get_attention_backend(device: str, ops: SimpleNamespace):
    """The Triton backend on CUDA when it exists; on a CPU with the CPU kernel table, the CPU
    backend (attention/cpu_backend.py); else the reference one over `ops`."""
    if str(device).startswith("cuda"):
        try:
            from slipstream.attention.triton_backend import TritonAttentionBackend  # Triton: optional
        except ImportError:
            logger.info("no Triton attention backend; using the reference backend on %s", device)
        else:
            return TritonAttentionBackend(ops)
    if getattr(ops, "name", None) == "cpu":
        return CpuAttentionBackend(ops)
    return ReferenceAttentionBackend(ops)


class Attention(nn.Module):
    """Multi-head / grouped-query attention for q [T, Hq*D], k and v [T, Hkv*D] (not rotated)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        """sliding_window W: a query sees its last W positions only (Mistral, Gemma's local
        layers); logit_softcap c: scores become c * tanh(scores / c) (Gemma 2)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap
        # Buffers, not parameters: weight loading, dummy init and checkpoint export skip them;
        # they follow the model's device and stay put for CUDA-graph replay.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.kv_scales_from_checkpoint: set[str] = set()  # "k_scale" / "v_scale" loaded
        # Spans of the weights the layer reads next, prefetched into L2 by batch-1-like decode
        # launches (kernels/attention/l2_prefetch.py; set by models' attach_l2_prefetch), or None.
        self.l2_prefetch: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kv = {}
        if k_cache.element_size() == 1:  # fp8 / int8 cache: the kernels (de)quantize
            kv = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if self.l2_prefetch is not None:
            kv["l2_prefetch"] = self.l2_prefetch
        if self.sliding_window is not None:
            kv["sliding_window"] = self.sliding_window
        if self.logit_softcap is not None:
            kv["logit_softcap"] = self.logit_softcap
        out = self.backend.forward(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta,
                                   self.scale, **kv)
        return out.reshape(t, self.num_heads * self.head_dim)
