"""Pre-quantized int4 MoE experts: GPTQ and AWQ (AutoAWQ GEMM) checkpoints store each expert's
`qweight / qzeros / scales` (GPTQ also `g_idx`) per expert module; they load into FusedMoE's
int4 layout (kernels/moe/reference.Int4Experts) with the dense loaders' unpacking
(quantization/utils.unpack_int32_cols, int4_layouts.act_order_perm).

Tensor parallelism (split experts): gate/up split their output rows, any cut works; down splits
its input columns, so a rank's slice must start and end on the checkpoint's group boundaries
(`slice_int4`), else a ValueError names expert parallelism as the way out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.parallel.checkpoint_slices import materialize
from slipstream.quantization.int4_layouts import act_order_perm, fp16_scales
from slipstream.quantization.utils import AWQ_ORDER, int4_groups, unpack_int32_cols

INT4_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4ExpertCheckpoint:
    """layout "awq" or "gptq"; gptq_zero_offset: GPTQ v1 stores zero - 1."""

    layout: str
    group_size: int
    gptq_zero_offset: int = 1

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return INT4_TENSORS[:3] if self.layout == "awq" else INT4_TENSORS


class PendingInt4Tensors:
    """Holds each (expert, part)'s checkpoint tensors until all of them are in."""

    def __init__(self, checkpoint: Int4ExpertCheckpoint):
        self.needed = len(checkpoint.tensor_names)
        self._parts: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, key: int, kind: str, tensor) -> dict[str, torch.Tensor] | None:
        parts = self._parts.setdefault(key, {})
        parts[kind] = materialize(tensor)
        if len(parts) < self.needed:
            return None
        return self._parts.pop(key)


def unpack_expert(tensors: dict[str, torch.Tensor], ckpt: Int4ExpertCheckpoint
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert projection's checkpoint tensors -> (q uint8 [N, K], scale float16 [N, G],
    zero uint8 [N, G]). GPTQ act-order (a g_idx that is not contiguous groups) is refused:
    the fused kernels read each expert's columns in order."""
    qweight, qzeros = tensors["qweight"].cpu(), tensors["qzeros"].cpu()
    if ckpt.layout == "awq":  # qweight [K, N/8], qzeros [G, N/8], packed along N
        q = unpack_int32_cols(qweight, AWQ_ORDER).t()
        zero = unpack_int32_cols(qzeros, AWQ_ORDER).t()
    else:  # GPTQ: qweight [K/8, N] packed along K; zeros minus one in 4 bits
        q = unpack_int32_cols(qweight.t().contiguous())
        zero = (unpack_int32_cols(qzeros).t() + ckpt.gptq_zero_offset) & 0xF
        g_idx = tensors["g_idx"].cpu().reshape(1, -1)
        if act_order_perm(g_idx, ckpt.group_size, tuple(q.shape)) is not None:
            raise ValueError("GPTQ act-order (desc_act) MoE experts are not supported: their "
                             "groups are not contiguous along K")
    scale = fp16_scales(tensors["scales"].t())
    n, k = q.shape
    if tuple(scale.shape) != (n, int4_groups(k, ckpt.group_size)) or zero.shape != scale.shape:
        raise ValueError(f"int4 expert: scales {tuple(scale.shape)} / zeros {tuple(zero.shape)} "
                         f"do not fit a [{n}, {k}] weight in groups of {ckpt.group_size}")
    return q.contiguous(), scale.contiguous(), zero.to(torch.uint8).contiguous()


def slice_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, start: int,
               size: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's cut of an unpacked expert weight: dim 0 output rows (any cut), dim 1 input
    columns (row-parallel: the cut must start on a group boundary and hold whole groups, or
    run to the end of K where the last group is short)."""
    if dim == 0:
        return q.narrow(0, start, size), scale.narrow(0, start, size), zero.narrow(0, start, size)
    k = q.shape[1]
    if start % group_size or (size % group_size and start + size != k):
        raise ValueError(f"int4 experts: a rank's {size} input columns from {start} do not hold "
                         f"whole groups of {group_size}; use a tensor_parallel_size that "
                         f"splits the expert intermediate size into multiples of the group "
                         f"size, or enable_expert_parallel=True")
    first, count = start // group_size, int4_groups(size, group_size)
    return (q.narrow(1, start, size), scale.narrow(1, first, count),
            zero.narrow(1, first, count))
