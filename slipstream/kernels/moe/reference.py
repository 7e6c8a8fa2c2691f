"""Plain-PyTorch twins of the MoE kernels: routing, the token sort, the expert products.

Conventions shared with the Triton kernels (kernels/moe/fused_moe.py):
- x [T, H] activations; w13 [E, 2I, H] each expert's [gate | up] weight; w2 [E, H, I] its down
  weight. Quantized experts hold int8 or fp8 weights with a float32 scale per output row
  ([E, 2I] and [E, H]); unquantized ones have no scale (None).
- int4 experts (Int4Experts): uint8 weights with two values a byte along K (even k in the low
  nibble), w13 [E, 2I, H/2] and w2 [E, H, I/2], and per group of `group_size` input columns a
  float16 (or float32) scale and a uint8 zero ([E, N, ceil(K/G)], the last group short where G does not
  divide K): w = (q - zero) * scale.
- topk_ids [T, k] int32: which of this rank's experts each token goes to, -1 for an expert the
  rank does not hold (expert parallelism: that pair adds nothing here). topk_weights [T, k]
  float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slipstream.quantization.utils import dequantize_int4_groupwise, unpack_int4_rows


@dataclass(frozen=True)
class Int4Experts:
    """The zero points and group size that go with int4 expert weights and their scales."""

    w13_zero: torch.Tensor
    w2_zero: torch.Tensor
    group_size: int


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the top_k of them; renormalize: the chosen weights
    divided by their sum (Mixtral always, Qwen-MoE when norm_topk_prob).
    Returns (weights float32 [T, k], expert ids int32 [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                       zero: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """One expert's w [N, K] (16-bit, or int8 / fp8 with scale [N]; or int4 packed [N, K/2]
    with scale and zero [N, groups]) -> dtype [N, K]."""
    if zero is not None:
        return dequantize_int4_groupwise(unpack_int4_rows(w), scale, zero, dtype, group_size)
    if scale is None:
        return w.to(dtype)
    return (w.float() * scale.float()[..., None]).to(dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, int4: Int4Experts | None = None
              ) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]:
    one loop over the experts that received tokens, torch matmuls in x's dtype, the weighted
    sum in float32. Returns [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue  # an expert this rank does not hold
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        gate_up = F.linear(x[tokens], dequantize_experts(w13[e], _row(w13_scale, e), x.dtype,
                                                         *_int4_args(int4, "w13_zero", e)))
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        down = F.linear(act, dequantize_experts(w2[e], _row(w2_scale, e), x.dtype,
                                                *_int4_args(int4, "w2_zero", e)))
        weight = topk_weights.reshape(-1)[pairs].float()
        out.index_add_(0, tokens, down.float() * weight[:, None])
    return out.to(x.dtype)


def _int4_args(int4: Int4Experts | None, zero: str, e: int) -> tuple:
    return () if int4 is None else (getattr(int4, zero)[e], int4.group_size)


def _row(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert into blocks of block_m rows, each expert's rows
    padded up to a whole block, so one grouped GEMM launch can give every block one expert.

    Returns (sorted_pairs int32 [capacity]: pair index t * k + j, or P = T * k for padding;
    block_experts int32 [capacity / block_m]: the expert of each block, -1 past the last used
    block; num_padded int32 [1]: rows in use). capacity = P + E * (block_m - 1) rounded up to a
    block: a size fixed by the shapes, so nothing is read back to the host (CUDA graphs).
    Pairs routed to -1 (experts held elsewhere) are left out."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    capacity = _round_up(num_pairs + num_experts * (block_m - 1), block_m)
    bucket = torch.where(flat < 0, num_experts, flat)  # the last bucket: dropped
    # scatter_add, not bincount: bincount reads its input's max back to the host on CUDA.
    sizes = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    sizes.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = sizes[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    bucket_first = torch.cumsum(sizes, 0) - sizes  # where each bucket starts in sorted order
    rank = torch.arange(num_pairs, device=device) - bucket_first[sorted_bucket]
    dest = starts[sorted_bucket.clamp(max=num_experts - 1)] + rank
    # Dropped pairs go to one scratch slot past the end (a boolean index would sync).
    dest = torch.where(sorted_bucket < num_experts, dest, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:capacity]
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    num_padded = ends[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32)
    return sorted_pairs, block_experts, num_padded


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
