"""GPTQ rounding (Frantar et al., 2022) into int4_awq's layout.

Round-to-nearest rounds every weight on its own. GPTQ rounds the input columns of a linear
layer one at a time and moves each column's rounding error onto the columns not yet rounded,
weighted by the inverse Hessian of the layer's output error, H = X^T X over calibration inputs
(any positive multiple of it: only H's shape matters). The rows of W are independent given H,
so a fused projection (qkv, gate_up) is one call.

Groups: a group's scale and zero point are computed from its columns as they stand when the
first of them is reached (earlier errors already spread onto them), with int4_awq's range rule
(utils.quantize_int4_groupwise: [min, max] holding 0, fp16 scales as stored), so the result is
the same qweight / scales / zeros layout every int4 kernel reads: any group size, a short last
group, per channel. Act-order (columns by descending diag(H)) uses static groups: the group
parameters are fixed from the weight before any error moves, in the original column order, so
the groups stay contiguous and nothing is permuted at load.

Plain torch, float32, on the weight's device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slipstream.quantization import utils as qu

DAMP = 0.01  # added to H's diagonal: this fraction of its mean (GPTQ's percdamp)
# The MLP's inputs (1536 channels into down_proj on SmolLM2) are estimated worse from a few
# thousand calibration tokens: more dampening measured better there (docs/quantization.md).
MLP_DAMP = 0.1
BLOCK = 128  # columns per lazy batch: errors reach the later columns once a batch is done
RANGE_STEPS = 10  # range_search: shrink factors 1 - i/20, i < 10
SINK_WEIGHT = 1.0  # the first token of a calibration block weighs this times the rest of it
MLP_SINK_WEIGHT = 0.0  # ... in the MLP's H: left out (its massive activations own H otherwise)


@dataclass(frozen=True)
class GptqOptions:
    """damp / mlp_damp: of H's mean diagonal, for the attention / MLP projections (a caller
    that knows no such split uses damp); act_order: columns by descending diag(H), static
    groups; sink_weight / mlp_sink_weight: see sink_weighted_gram; quantized_inputs: a
    layer-by-layer caller feeds each layer the previous layers' quantized outputs, not the
    float model's; range_search: see group_params; block: columns per lazy batch."""

    damp: float = DAMP
    mlp_damp: float = MLP_DAMP
    act_order: bool = False
    sink_weight: float = SINK_WEIGHT
    mlp_sink_weight: float = MLP_SINK_WEIGHT
    quantized_inputs: bool = False
    range_search: bool = False
    block: int = BLOCK


def sink_weighted_gram(x: torch.Tensor, sink_weight: float = SINK_WEIGHT) -> torch.Tensor:
    """H for a projection's inputs x [B, T, K] (blocks of T calibration tokens): the weighted
    mean of x_t x_t^T, the first token of each block weighing sink_weight * (T - 1) tokens
    (1 / (T - 1): plain H; 0: left out).

    Every later query attends to a sequence's first token (the attention sink), so an error in
    its keys and values moves the attention of the whole block; counted once among T tokens, it
    is the token GPTQ sacrifices to fit the others. On SmolLM2-135M, plain H gave GPTQ on q/k/v
    +13% perplexity where round-to-nearest costs +6% (docs/quantization.md). In the MLP the
    same token's inputs hold the massive activations: weighted up they own H (down_proj +35%),
    left out they leave the other tokens' H and its dampening to the other tokens."""
    b, t, k = x.shape
    weights = torch.ones(b, t, 1, dtype=torch.float32, device=x.device)
    weights[:, 0] = sink_weight * (t - 1) if t > 1 else 1.0
    x = x.float()
    return torch.einsum("btk,btl->kl", x * weights, x) / weights.sum()


def group_params(w: torch.Tensor, range_search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N] of one group's columns w [N, g], as quantize_int4_groupwise computes
    them, the scale rounded to float16 as the checkpoint stores it (the rounding GPTQ then
    compensates is the one the model computes with). range_search: each row's [min, max]
    shrunk by the factor (1, 0.95, ..., 0.55) whose grid rounds the group with the least
    squared error (GPTQ's own "mse" grid search)."""
    lo = w.amin(dim=1).clamp(max=0.0)
    hi = w.amax(dim=1).clamp(min=0.0)  # the range holds 0: a zero-padded short group is the same
    best = _range_params(lo, hi)
    if range_search:
        best_err = _group_error(w, *best)
        for i in range(1, RANGE_STEPS):
            cand = _range_params(lo * (1 - i / 20), hi * (1 - i / 20))
            err = _group_error(w, *cand)
            better = err < best_err
            best = tuple(torch.where(better, c, b) for c, b in zip(cand, best, strict=True))
            best_err = torch.minimum(err, best_err)
    return best


def _range_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = ((hi - lo) / 15.0).clamp_min(1e-8)
    z = torch.round(-lo / s).clamp_(0, 15)
    return s.half().float(), z


def _group_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    q = torch.round(w / scale.clamp_min(1e-30)[:, None] + zero[:, None]).clamp_(0, 15)
    return ((q - zero[:, None]) * scale[:, None] - w).pow(2).sum(dim=1)


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, dequantized) of one column w [N] on its group's grid."""
    q = torch.round(w / scale.clamp_min(1e-30) + zero).clamp_(0, 15)
    return q, (q - zero) * scale


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U of (H + damp * mean(diag H) I)^-1 = U^T U. A column whose
    input is always zero (diag 0) gets a unit diagonal: its weight never reaches the output,
    and the factorisation stays defined."""
    h = h.float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean = torch.diagonal(h).mean()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for factor in (damp, 10 * damp, 100 * damp):  # near-singular H (few tokens): damp harder
        chol, info = torch.linalg.cholesky_ex(h + factor * mean * eye)
        if info.item() == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    raise ValueError("GPTQ: the calibration inputs' second moment is not positive definite "
                     "even when damped; give more calibration tokens")


def segments(k: int, group_size: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) batches of columns no longer than `block` that start at every group
    boundary: a group's parameters are taken when its first column comes, with every earlier
    batch's error already on it."""
    cuts = sorted({*range(0, k, block), *range(0, k, group_size), k})
    return list(zip(cuts[:-1], cuts[1:]))


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int,
                  options: GptqOptions = GptqOptions(),
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of w [N, K] for inputs of second moment h [K, K] -> (q uint8 [N, K] in 0..15,
    scales float16 [N, ceil(K/G)], zeros uint8 [N, ceil(K/G)]), w ~= (q - zero) * scale per
    group, as utils.quantize_int4_groupwise returns them. group_size <= 0: per channel."""
    n, k = w.shape
    g = group_size if group_size > 0 else k
    if h.shape != (k, k):
        raise ValueError(f"GPTQ: a [{k}, {k}] Hessian for a weight of {k} inputs, got "
                         f"{tuple(h.shape)}")
    w, h = w.float().clone(), h.to(w.device).float()
    w[:, torch.diagonal(h) == 0] = 0.0  # inputs always zero: the weight is never read
    groups = qu.int4_groups(k, g)
    scales = w.new_empty(n, groups)
    zeros = w.new_empty(n, groups)
    order = None
    if options.act_order:  # static groups, from the untouched weight, in column order
        for j in range(groups):
            scales[:, j], zeros[:, j] = group_params(w[:, j * g:(j + 1) * g], options.range_search)
        order = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, order], h[order][:, order]
    u = inverse_hessian_factor(h, options.damp)
    q = _run(w, u, g, scales, zeros, order, options.block, options.range_search)
    if order is not None:
        q = q[:, torch.argsort(order)]
    return q.to(torch.uint8), scales.half(), zeros.to(torch.uint8)


def _run(w: torch.Tensor, u: torch.Tensor, g: int, scales: torch.Tensor, zeros: torch.Tensor,
         order: torch.Tensor | None, block: int, range_search: bool) -> torch.Tensor:
    """The column loop on w (permuted by `order` if given), in place; returns q in w's column
    order. Without `order` each group's parameters are set into scales / zeros when reached."""
    n, k = w.shape
    q = torch.empty_like(w)
    group_of = (torch.arange(k) if order is None else order.cpu()).div(g, rounding_mode="floor")
    group_of = group_of.tolist()  # one host read, not one a column
    for start, stop in segments(k, g if order is None else k, block):
        if order is None and start % g == 0:
            j = start // g
            scales[:, j], zeros[:, j] = group_params(w[:, start:start + g], range_search)
        wb, ub = w[:, start:stop], u[start:stop, start:stop]
        err = torch.empty_like(wb)
        for i in range(stop - start):
            j = group_of[start + i]
            q[:, start + i], deq = quantize_column(wb[:, i], scales[:, j], zeros[:, j])
            err[:, i] = (wb[:, i] - deq) / ub[i, i]
            wb[:, i:] -= err[:, i:i + 1] * ub[i:i + 1, i:]
        w[:, stop:] -= err @ u[start:stop, stop:]
    return q


def install_int4(linear: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> None:
    """Replace linear's float weight by int4_awq's canonical tensors (qweight uint8 [N, K/2],
    scales, zeros): int4_awq's process_after_loading then keeps them as they are."""
    from slipstream.quantization.int4_awq import GROUP_ATTR  # int4_awq imports awq, awq this

    dev = linear.weight.device
    del linear._parameters["weight"]
    qu.replace_param(linear, "qweight", qu.pack_int4_rows(q).to(dev), output_dim=0)
    qu.replace_param(linear, "scales", scales.to(dev), output_dim=0)
    qu.replace_param(linear, "zeros", zeros.to(dev), output_dim=0)
    setattr(linear, GROUP_ATTR, group_size if group_size > 0 else q.shape[1])
