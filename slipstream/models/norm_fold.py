"""Fold each decoder layer's RMSNorm weights into the projection that the norm feeds.

RMSNorm(h) @ W^T = (h / rms(h)) @ (W * gamma)^T: with gamma folded into W's columns at load (before
quantization), the norm keeps weight 1 and the network computes the same function. A one-row
decode can then drop both norm kernels of a layer (llama.LlamaDecoderLayer): the QKV and gate/up
GEMVs take 1 / rms(h) from the sum of squares of the h they load anyway, and the residual adds
move into the epilogues of the o and down GEMVs. Computing the norm with its weight inside the
GEMV instead costs more than the norm kernel it saves (the weight's load and product in every
tile); the fold removes that cost.

Which layers fold is the quant method's choice (QuantMethod.folds_norm): those that round the
weights at load anyway (int8_wo, fp8, int4_awq's round-to-nearest; the folded weight's 16-bit
rounding is far below their quantization step). A method may veto a fold that would round the
weight worse (fold_costs_accuracy: int4's groups along K). Unquantized layers keep the checkpoint's weights
bit for bit, so greedy tokens match transformers'. Pre-quantized checkpoints, and calibrations
that read or rescale the norms (AWQ's layer hook, SmoothQuant), keep their norms; so do
checkpoints written by `slipstream quantize` (kept_norms).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

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
    """{projection module path: the RMSNorm module path that feeds it} (empty inside
    kept_norms, or for a model without norm_fold_pairs)."""
    pairs = getattr(model, "norm_fold_pairs", None)
    if _KEEP_NORMS.get() or pairs is None:
        return {}
    return pairs()


def can_fold(linear: nn.Module, norm: nn.Module) -> bool:
    """Whether linear's weight is still a 16-bit [N, K] matrix, K = the norm's size, that its
    method quantizes at load (folds_norm)."""
    w = linear._parameters.get("weight")
    method = getattr(linear, "quant_method", None)
    return (w is not None and not w.is_meta and w.is_floating_point() and w.element_size() >= 2
            and w.dim() == 2 and w.shape[1] == norm.weight.shape[0]
            and getattr(method, "folds_norm", False) and not getattr(norm, "folded", False)
            and not _fold_costs_accuracy(method, w, norm.weight))


def _fold_costs_accuracy(method, weight: torch.Tensor, gamma: torch.Tensor) -> bool:
    """A method's veto (QuantMethod.fold_costs_accuracy, where it has one): int4's groups along
    K, for one, round a folded weight worse where gamma spreads widely within a group."""
    veto = getattr(method, "fold_costs_accuracy", None)
    return bool(veto is not None and veto(weight, gamma))


@torch.no_grad()
def fold_norm(linear: nn.Module, norm: nn.Module) -> None:
    """W <- W * gamma (in float32, rounded once), gamma <- 1; marks the norm folded."""
    w = linear.weight
    w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
    norm.weight.fill_(1.0)
    norm.folded = True
