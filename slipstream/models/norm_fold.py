"""Fold each decoder layer's RMSNorm weights into the projection that the norm feeds.

RMSNorm(h) @ W^T = (h / rms(h)) @ (W * gamma)^T: with gamma folded into W's columns at load (before
quantization), the norm keeps weight 1 and the network computes the same function. A one-row
decode can then drop both norm kernels of a layer (llama.LlamaDecoderLayer): the QKV and gate/up
GEMVs take 1 / rms(h) from the sum of squares of the h they load anyway, and the residual adds
move into the epilogues of the o and down GEMVs. H200 W1: each norm kernel costs ~1.5 us on the
critical path (64 a token, ~0.1 ms); computing the norm with its weight inside the GEMV cost more
than that (session 9: the weight's load and product in every tile), which the fold removes.

Off by default until measured on a GPU: SLIPSTREAM_FOLD_NORMS=1. Only projections that still hold
16-bit weights when they are processed are folded (unquantized; int8_wo, fp8 and int4_awq's
round-to-nearest quantized at load); pre-quantized checkpoints, and calibrations that read or
rescale the norms (AWQ's layer hook, SmoothQuant), keep their norms.
"""
from __future__ import annotations

import os

import torch
from torch import nn

FOLD_NORMS = os.environ.get("SLIPSTREAM_FOLD_NORMS", "0") == "1"


def fold_pairs(model: nn.Module) -> dict[str, str]:
    """{projection module path: the RMSNorm module path that feeds it} (empty when off)."""
    pairs = getattr(model, "norm_fold_pairs", None)
    return pairs() if FOLD_NORMS and pairs is not None else {}


def can_fold(linear: nn.Module, norm: nn.Module) -> bool:
    """Whether linear's weight is still a 16-bit [N, K] matrix its method quantizes (or uses)
    as is, with K = the norm's size."""
    w = linear._parameters.get("weight")
    method = getattr(linear, "quant_method", None)
    return (w is not None and not w.is_meta and w.is_floating_point() and w.element_size() >= 2
            and w.dim() == 2 and w.shape[1] == norm.weight.shape[0]
            and getattr(method, "folds_norm", False) and not getattr(norm, "folded", False))


@torch.no_grad()
def fold_norm(linear: nn.Module, norm: nn.Module) -> None:
    """W <- W * gamma (in float32, rounded once), gamma <- 1; marks the norm folded."""
    w = linear.weight
    w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
    norm.weight.fill_(1.0)
    norm.folded = True
