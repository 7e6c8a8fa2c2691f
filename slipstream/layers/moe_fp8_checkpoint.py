"""Pre-quantized FP8 experts: each expert tensor of the checkpoint comes with its scale (one per
tensor, one per output row, or one per block), the two in either order; once both are in they
become the experts' layout, fp8 rows with one float32 scale per row (what the MoE kernels read).

Block scales are requantized per row at load (a second FP8 rounding, as for dense layers,
fp8_layouts.requantize_blocks_per_channel). A tensor-parallel slice is cut before that, so
each rank's row scales fit its own slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.parallel.checkpoint_slices import materialize
from slipstream.quantization.fp8_layouts import dequantize_blockwise
from slipstream.quantization.utils import quantize_fp8_per_channel

# Static activation scales of the checkpoint: read and unused (the MoE kernels are weight-only).
UNUSED_TENSORS = ("input_scale", "input_scale_ub")


@dataclass(frozen=True)
class Fp8ExpertCheckpoint:
    """How a checkpoint stores its FP8 expert scales."""

    block_size: tuple[int, int] | None = None  # (rows, cols) of block scales; None: row / tensor
    scale_name: str = "weight_scale"  # the scales' leaf name (block-wise HF: weight_scale_inv)


class PendingExpertTensors:
    """Holds each (expert, part)'s weight or scale until its partner arrives."""

    def __init__(self):
        self._parts: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, shard: int, kind: str, tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight, scale) once both of `shard` are in, else None."""
        parts = self._parts.setdefault(shard, {})
        parts[kind] = materialize(tensor)
        if len(parts) < 2:
            return None
        del self._parts[shard]
        return parts["weight"], parts["scale"]


def per_row_fp8(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8ExpertCheckpoint,
                cut: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [R, K], float32 scale [R]) from a checkpoint tensor and its scale; cut:
    (dim, start, length) of this rank's slice."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected an fp8 (e4m3) expert weight, got {weight.dtype}")
    if fmt.block_size is not None:
        w = dequantize_blockwise(weight, scale, fmt.block_size)
        return quantize_fp8_per_channel(w.narrow(*cut) if cut else w)
    rows = scale.float().reshape(-1)
    if rows.numel() == 1:
        rows = rows.expand(weight.shape[0])
    elif rows.numel() != weight.shape[0]:
        raise ValueError(f"fp8 expert scale of {rows.numel()} values for {weight.shape[0]} rows: "
                         "expected one per tensor or one per row")
    if cut is not None:
        weight = weight.narrow(*cut)
        if cut[0] == 0:  # rows cut: their scales too; a column cut keeps every row's scale
            rows = rows.narrow(0, cut[1], cut[2])
    return weight, rows.contiguous()
