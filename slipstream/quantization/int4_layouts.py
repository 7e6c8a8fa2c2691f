"""Pre-quantized INT4 checkpoint layouts -> int4_awq's canonical one: GPTQ act-order column orders
(g_idx), compressed-tensors pack-quantized zero points and shapes, and the loaders that check
them as they arrive."""
from __future__ import annotations

import logging

import torch
from torch import nn

from slipstream.quantization import utils as qu

logger = logging.getLogger(__name__)

CT_ZERO = 8  # compressed-tensors stores signed 4-bit q as q + 8: symmetric layers have zero 8


def act_order_perm(g_idx: torch.Tensor, group_size: int,
                   shape: tuple[int, int]) -> torch.Tensor | None:
    """The input column order that makes GPTQ's groups contiguous, or None when they already are.

    g_idx [shards, K] int: the group of each input column, one row per fused shard. Act-order
    quantizes columns by decreasing activation size, so a group's columns lie anywhere in K;
    the stable argsort lists group 0's columns, then group 1's, ... (the order of scales/zeros).
    """
    n, k = shape
    if not torch.equal(g_idx, g_idx[:1].expand_as(g_idx)):
        raise ValueError(f"int4_awq: the fused shards of a [{n}, {k}] GPTQ layer have different "
                         "g_idx; only one input column order per layer is supported")
    g_idx, groups = g_idx[0].long(), qu.int4_groups(k, group_size)
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    want = torch.full((groups,), group_size)
    want[-1] = k - (groups - 1) * group_size  # a short last group where G does not divide K
    in_range = bool(((g_idx >= 0) & (g_idx < groups)).all())
    if not in_range or not torch.equal(torch.bincount(g_idx, minlength=groups), want):
        raise ValueError(f"int4_awq: GPTQ g_idx of a [{n}, {k}] layer must give each of its "
                         f"{groups} groups exactly {group_size} input columns (the last one "
                         f"{int(want[-1])}; found groups {int(g_idx.min())}..{int(g_idx.max())} "
                         f"with {group_size_range(g_idx, groups)} columns)")
    return torch.argsort(g_idx, stable=True)


def group_size_range(g_idx: torch.Tensor, groups: int) -> str:
    counts = torch.bincount(g_idx.clamp(min=0), minlength=groups)[:groups]
    return f"{int(counts.min())}..{int(counts.max())}"


def check_act_order_split(layer: nn.Module) -> None:
    """Row-parallel layers split K across ranks, but an act-order group's columns lie anywhere in
    K: a rank's slice would hold partial groups of every group, which this layout cannot hold."""
    if getattr(layer, "tp_split", None) == "input" and getattr(layer, "tp_size", 1) > 1:
        raise NotImplementedError(
            f"int4_awq: GPTQ act-order (desc_act) checkpoints cannot split a row-parallel layer "
            f"(input size {layer.input_size} per rank) across tensor_parallel_size="
            f"{layer.tp_size} ranks; load them with tensor_parallel_size=1")


def weight_shape_loader(output_sizes: list[int], k: int):
    """weight_shape (N, K) of each checkpoint module: checked against the layer's shard."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        index = shard or 0
        want = (output_sizes[index] if shard is not None else sum(output_sizes), k)
        found = tuple(int(v) for v in loaded.reshape(-1).tolist())
        if found != want:
            raise ValueError(f"weight_shape {list(found)} does not match the layer's {list(want)}")
        param.data[index].copy_(torch.tensor(want))

    return load


def zero_point_loader(output_sizes: list[int]):
    """weight_zero_point -> canonical zeros in the shard's rows (see ct_zero_points)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        dest = param.data
        if shard is not None:
            dest = dest.narrow(0, sum(output_sizes[:shard]), output_sizes[shard])
        dest.copy_(ct_zero_points(loaded, tuple(dest.shape)))

    return load


def ct_zero_points(loaded: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors asymmetric zero points -> uint8 [N, K/G] in 0..15 (our zero = zp + 8).

    compressed-tensors >= 0.10 packs them like the weight but along N: int32 [ceil(N/8), K/G],
    nibble i of row j holding output row 8j + i, stored as zp + 8. Older versions saved the
    signed values unpacked, [N, K/G].
    """
    n, groups = shape
    if loaded.dtype == torch.int32 and tuple(loaded.shape) == ((n + 7) // 8, groups):
        return qu.unpack_int32_cols(loaded.t().contiguous())[:, :n].t()
    if tuple(loaded.shape) == (n, groups) and not loaded.is_floating_point():
        zeros = loaded.to(torch.int16) + CT_ZERO
        if bool(((zeros < 0) | (zeros > 15)).any()):
            raise ValueError("weight_zero_point outside the signed 4-bit range -8..7")
        return zeros.to(torch.uint8)
    raise ValueError(f"weight_zero_point {loaded.dtype} {list(loaded.shape)}: expected int32 "
                     f"[{(n + 7) // 8}, {groups}] (packed along N) or [{n}, {groups}]")


def fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    """The canonical float16 scales; bf16 scales are exact in fp16's normal range."""
    half = scales.half()
    if not bool(torch.isfinite(half).all()):
        raise ValueError(f"int4_awq: weight scales up to {scales.abs().max().item():.3g} exceed "
                         "float16's range")
    error = ((half.float() - scales.float()).abs() / scales.float().abs().clamp_min(1e-30)).max()
    if error.item() > 2.0 ** -11:  # more than float16 rounding: tiny (subnormal) scales
        logger.warning("int4_awq: float16 loses precision on some weight scales (relative error "
                       "up to %.2g)", error.item())
    return half


def g_idx_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    """g_idx [shards, K]: row `shard` (every row for an unfused tensor)."""
    if loaded.numel() != param.shape[1]:
        raise ValueError(f"g_idx has {loaded.numel()} entries, the layer's input size is "
                         f"{param.shape[1]}")
    rows = param.data if shard is None else param.data[shard:shard + 1]
    rows.copy_(loaded.reshape(1, -1))
