"""Gated MLP activation: silu(gate) * up on a fused [gate | up] tensor."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

_SUPPORTED = ("silu", "swish")


class SiluAndMul(nn.Module):
    def __init__(self, ops: SimpleNamespace, act: str = "silu"):
        super().__init__()
        if act not in _SUPPORTED:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_SUPPORTED)}")
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
