"""Fold each decoder layer's RMSNorm weights into the projection that the norm feeds.

RMSNorm(h) @ W^T = (h / rms(h)) @ (W * gamma)^T: with gamma folded into W's columns at load (before
quantization), the norm keeps weight 1 and the network computes the same function. A one-row
decode can then drop both norm kernels of a layer (llama.LlamaDecoderLayer): the QKV and gate/up
GEMVs take 1 / rms(h) from the sum of squares of the h they load anyway, and the residual adds
move into the epilogues of the o and down GEMVs. H200 W1: each norm kernel costs ~1.5 us on the
critical path (64 a token, ~0.1 ms); computing the norm with its weight inside the GEMV cost more
than that (session 9: the weight's load and product in every tile), which the fold removes.

SLIPSTREAM_FOLD_NORMS: `auto` (the default) folds where the method rounds the weights at load
anyway (int8_wo, fp8, int4_awq's round-to-nearest; the folded weight's 16-bit rounding is far
below their quantization step). `all` folds unquantized weights too (one more rounding of the
checkpoint's bf16 weights: greedy tokens may then differ from transformers'); `0` never folds.
H200 W1 (session 19): int4_awq+head 425 -> 450 tok/s, int8_wo+head ~370 -> 374, fp8+head ~382
-> 385, bf16 231 -> 235 with `all`. Pre-quantized checkpoints, and calibrations that read or
rescale the norms (AWQ's layer hook, SmoothQuant), keep their norms; so do checkpoints written
by `slipstream quantize` (kept_norms).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch
from torch import nn

from slipstream.quantization.base import UnquantizedLinearMethod

_MODES = {"auto": "auto", "all": "all", "1": "all", "0": "off", "off": "off"}


def _mode(value: str) -> str:
    if value.lower() not in _MODES:
        raise ValueError(f"SLIPSTREAM_FOLD_NORMS={value!r}: expected auto, all (or 1) or 0")
    return _MODES[value.lower()]


FOLD_NORMS = _mode(os.environ.get("SLIPSTREAM_FOLD_NORMS", "auto"))  # "auto" | "all" | "off"


_KEEP_NORMS: contextvars.ContextVar[bool] = contextvars.ContextVar("slipstream_keep_norms",
                                                                    default=False)


@contextlib.contextmanager
def kept_norms() -> Iterator[None]:
    """Models loaded in this context fold nothing: a checkpoint written from them keeps the
    source's norms (the fold is a serving-time layout, applied again at every load)."""
    token = _KEEP_NORMS.set(True)
    try:
        yield
    finally:
        _KEEP_NORMS.reset(token)


def fold_pairs(model: nn.Module) -> dict[str, str]:
    """{projection module path: the RMSNorm module path that feeds it} (empty when off)."""
    pairs = getattr(model, "norm_fold_pairs", None)
    if FOLD_NORMS == "off" or _KEEP_NORMS.get() or pairs is None:
        return {}
    return pairs()


def can_fold(linear: nn.Module, norm: nn.Module) -> bool:
    """Whether linear's weight is still a 16-bit [N, K] matrix its method quantizes (or, under
    `all`, uses as is), with K = the norm's size."""
    w = linear._parameters.get("weight")
    method = getattr(linear, "quant_method", None)
    if FOLD_NORMS == "auto" and isinstance(method, UnquantizedLinearMethod):
        return False  # kept bit-exact to the checkpoint
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
