"""Gated MLP activations on a fused [gate | up] tensor: silu(gate) * up (through the kernel
table, fused into the GEMVs where they can) and gelu_tanh(gate) * up (Gemma's GeGLU)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from slipstream.kernels import reference

_SUPPORTED = ("silu", "swish")


class SiluAndMul(nn.Module):
    def __init__(self, ops: SimpleNamespace, act: str = "silu"):
        super().__init__()
        if act not in _SUPPORTED:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_SUPPORTED)}")
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up through the kernel table (gelu_tanh_and_mul). The
    quant methods' fused gated GEMVs compute SiLU only, so callers run the down projection on
    this output (not forward_gated)."""

    def __init__(self, ops: SimpleNamespace, act: str = "gelu_pytorch_tanh"):
        super().__init__()
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported hidden_activation {act!r}; supported: "
                             f"{', '.join(_GELU_TANH)}")
        self.op = getattr(ops, "gelu_tanh_and_mul", None) or reference.gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)
