"""int8_wo: INT8 weight-only quantization, one scale per output channel, bf16 activations.

Weights are quantized at load time (or loaded pre-quantized: `weight` int8 + `weight_scale`).
Decode-size batches run a Triton dequant-GEMV; larger ones convert the weight and use cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization.base import QuantMethod, register_quant_method
from slipstream.quantization.utils import (
    check_checkpoint_method,
    new_param,
    quantize_int8_per_channel,
    replace_param,
)

CHECKPOINT_CONFIG = {"quant_method": "int8_wo", "bits": 8, "weight_scale": "per_channel"}


class PerChannelMethod(QuantMethod):
    """Shared by int8_wo and fp8: weight [N, K] in one byte, weight_scale float32 [N]."""

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None,
                    act) -> torch.Tensor:
        """Decode-size batches on CUDA: the dequant-GEMV computes act(gate_up) as it loads x
        (one launch less); anything else: apply(act(gate_up))."""
        m = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
        if gate_up.is_cuda and 0 < m <= _SMALL_M and _qlinear_small() is not None:
            return _qlinear_small()(gate_up, layer.weight, layer.weight_scale, bias, gated=True)
        return self.apply(layer, act(gate_up), bias)

    def checkpoint_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Fused tensors in checkpoint layout: leaf -> (tensor, output dim, pack factor)."""
        return {"weight": (layer.weight.data, 0, 1), "weight_scale": (layer.weight_scale.data, 0, 1)}


class Int8WeightOnlyMethod(PerChannelMethod):
    """weight int8 [N, K] (output_dim 0), weight_scale float32 [N]; y = (x @ q^T) * scale."""

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        n = sum(output_sizes)
        if self.prequantized:
            layer.register_parameter("weight", new_param(
                torch.empty(n, input_size, dtype=torch.int8), output_dim=0, input_dim=1))
            layer.register_parameter("weight_scale", new_param(
                torch.empty(n, dtype=torch.float32), output_dim=0))
        else:  # load the float checkpoint as usual (fused shards included), quantize after
            layer.register_parameter("weight", new_param(
                torch.empty(n, input_size, dtype=params_dtype), output_dim=0, input_dim=1))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if self.prequantized or layer.weight.dtype == torch.int8:
            return
        q, scale = quantize_int8_per_channel(layer.weight.data)
        replace_param(layer, "weight", q, output_dim=0, input_dim=1)
        replace_param(layer, "weight_scale", scale, output_dim=0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (qweight * scale[:, None])^T (+ bias) in x's dtype."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if x.is_cuda and 0 < m <= _SMALL_M:
        small = _qlinear_small()
        if small is not None:
            return small(x, qweight, scale, bias)
    # Large M (and the CPU reference): INT8 values are exact in x's dtype; scale the output.
    out = F.linear(x, qweight.to(x.dtype))
    out = out * scale.to(out.dtype)
    return out if bias is None else out + bias


_SMALL_M = 16
_QLINEAR_SMALL: list = []



def _qlinear_small():
    """kernels.gemv_int8.qlinear_small, or None when Triton cannot load (then torch is used)."""
    if not _QLINEAR_SMALL:
        try:
            from slipstream.kernels.gemv_int8 import qlinear_small
        except ImportError:
            qlinear_small = None
        _QLINEAR_SMALL.append(qlinear_small)
    return _QLINEAR_SMALL[0]


@register_quant_method("int8_wo")
def make_int8_wo(hf_config: dict):
    prequantized = check_checkpoint_method("int8_wo", hf_config)
    return lambda prefix: Int8WeightOnlyMethod(prequantized)


def make_method() -> Int8WeightOnlyMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`)."""
    return Int8WeightOnlyMethod(prequantized=False)


def checkpoint_config() -> dict:
    return dict(CHECKPOINT_CONFIG)
