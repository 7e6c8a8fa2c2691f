"""Reference attention backend: rotary + paged KV write, then attention over the paged cache.

It composes two ops of the kernel table, so on the CPU it is the plain-PyTorch oracle; a
fused Triton backend implements the same `forward` signature. fp8 / int8 caches pass the
layer's k_scale / v_scale (device scalars) to both ops.
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
        meta: AttentionMetadata, scale: float, *, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None, l2_prefetch: torch.Tensor | None = None,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:
        # l2_prefetch is a hint for the fused decode kernel (TritonAttentionBackend): unused here.
        # Scales and options travel only when given, so op tables without the keywords work.
        kv = {} if k_scale is None and v_scale is None else {"k_scale": k_scale,
                                                            "v_scale": v_scale}
        q, _ = self.ops.rotary_and_cache_write(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, **kv)
        return self.ops.paged_attention(q, k_cache, v_cache, meta, scale, **kv,
                                        **attention_options(sliding_window, logit_softcap))


def attention_options(sliding_window: int | None, logit_softcap: float | None) -> dict:
    """The paged_attention keywords of a layer's options, only those it sets."""
    opts = {}
    if sliding_window:
        opts["sliding_window"] = sliding_window
    if logit_softcap is not None:
        opts["logit_softcap"] = logit_softcap
    return opts
