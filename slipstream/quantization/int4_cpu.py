"""int4 layers on a CPU through torch's int4 GEMM (`torch._weight_int4pack_mm_for_cpu`).

The reference twin dequantizes the whole [N, K] weight at every call, which made int4 several
times slower than float on a CPU. torch's kernel reads the packed nibbles directly, with bf16
activations and one bf16 (scale, offset) pair per group: w = (q - 8) * scale + offset, so an
integer zero z becomes offset (8 - z) * scale and a float zero zs (GGUF Q4_1) 8 * scale - zs.

It takes groups of 32, 64, 128 or 256 that divide K and N a multiple of 16. Any group size G
that one of those divides is run as sub-groups sharing their group's pair, which also covers a
short last group (K not a multiple of G) and one group per row. Other layers, and more rows
than `MAX_ROWS`, keep the reference twin. The packed copy is built at a layer's first CPU call
and kept beside `qweight` (half a byte a weight more on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import slipstream.quantization.utils as qu

# Rows up to which torch's int4 GEMM beats dequantize + F.linear (one thread, SmolLM2's
# gate/up [1536, 576]: 1.3 against 2.3 ms at 32 rows, 5.3 against 4.1 at 128).
MAX_ROWS = 32
_SUB_GROUPS = (256, 128, 64, 32)
_PACKED = "_int4_cpu_pack"  # the layer attribute holding (packed weight, pairs, sub-group)
_HAS_KERNEL = hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch, "_convert_weight_to_int4pack_for_cpu")


def forget(layer: nn.Module) -> None:
    """Drop a layer's packed copy (its weights were replaced)."""
    layer.__dict__.pop(_PACKED, None)


def sub_group(n: int, k: int, group_size: int) -> int | None:
    """The kernel's group size for a layer with groups of group_size along K, or None when the
    kernel cannot take the layer."""
    if n % 16:
        return None
    for g in _SUB_GROUPS:
        if group_size % g == 0 and k % g == 0:
            return g
    return None


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group_size: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(packed weight, [K/g, N, 2] bf16 (scale, offset) pairs, g) for torch's kernel, or None
    where it cannot take the layer."""
    q = qu.unpack_int4_rows(qweight)
    n, k = q.shape
    g = sub_group(n, k, group_size)
    if g is None:
        return None
    s = scales.float()
    offset = 8 * s - zeros.float() if zeros.is_floating_point() else (8 - zeros.float()) * s
    group_of_sub = torch.arange(k // g) * g // group_size  # never past a group's end: g | G
    pairs = torch.stack([s[:, group_of_sub], offset[:, group_of_sub]], dim=-1)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return packed, pairs.transpose(0, 1).to(torch.bfloat16).contiguous(), g


def linear(layer: nn.Module, x: torch.Tensor, group_size: int,
           bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ W^T (+ bias) in x's dtype through torch's int4 GEMM, or None where the reference
    twin must run (not a CPU tensor, too many rows, a shape the kernel cannot take)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not _HAS_KERNEL or x.device.type != "cpu" or not 0 < rows <= MAX_ROWS:
        return None
    packed = getattr(layer, _PACKED, None)
    if packed is None:
        packed = pack(layer.qweight.data, layer.scales.data, layer.zeros.data, group_size)
        setattr(layer, _PACKED, packed if packed is not None else False)
    if not packed:
        return None
    weight, pairs, g = packed
    out = torch._weight_int4pack_mm_for_cpu(x.reshape(rows, k).to(torch.bfloat16), weight, g,
                                            pairs)
    out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias
