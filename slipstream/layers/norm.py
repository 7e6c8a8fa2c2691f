"""RMSNorm through the kernel table (reference ops on CPU, Triton twins on CUDA)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from slipstream.parallel.checkpoint_slices import materialize


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim; with `residual`, adds it first (fused).

    weight_offset: the checkpoint stores the scale minus this (Gemma's x * (1 + w)). The offset
    is added as the tensor loads, in float32 (the parameter is float32 then: 1 + w in bf16
    would round w away), so every kernel sees the scale itself; a written checkpoint subtracts
    it again (the parameter's checkpoint_offset)."""

    def __init__(self, size: int, eps: float, params_dtype: torch.dtype, ops: SimpleNamespace,
                 weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight_offset = weight_offset
        dtype = torch.float32 if weight_offset else params_dtype
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        if weight_offset:
            self.weight.checkpoint_offset = weight_offset
        self.folded = False  # weight folded into the next projection (models/norm_fold.py): all 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        loaded = materialize(loaded)  # a distributed rank's lazily read tensor
        if param.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                             f"{tuple(param.shape)}")
        param.data.copy_(loaded.float() + self.weight_offset if self.weight_offset else loaded)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head norm (Qwen3 q/k norm): x [T, H, D] normalised over D, as a 2-D call."""
        t, h, d = x.shape
        return self.ops.rms_norm(x.reshape(t * h, d), self.weight, self.eps).view(t, h, d)
