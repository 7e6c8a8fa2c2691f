"""RMSNorm through the kernel table (reference ops on CPU, Triton twins on CUDA)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim; with `residual`, adds it first (fused)."""

    def __init__(self, size: int, eps: float, params_dtype: torch.dtype, ops: SimpleNamespace):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(size, dtype=params_dtype), requires_grad=False)
        self.folded = False  # weight folded into the next projection (models/norm_fold.py): all 1

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
