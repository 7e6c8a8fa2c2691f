"""int8_wo: INT8 weight-only quantization, one scale per output channel, bf16 activations.

Weights are quantized at load time (or loaded pre-quantized: `weight` int8 + `weight_scale`, or a
compressed-tensors INT8 checkpoint: the same tensors with [N, 1] scales, or pack-quantized words).
Decode-size batches run a Triton dequant-GEMV, larger ones a Triton GEMM that converts the weight
tiles in registers (or, where measured faster, convert the whole weight and use cuBLAS). On the
CPU, up to 8 rows run torch's INT8-weight GEMM with bf16 activations, more convert the weight.
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization import compressed_tensors
from slipstream.quantization.base import QuantMethod, UnquantizedLinearMethod, register_quant_method
from slipstream.quantization.compressed_tensors import Int8Layout
from slipstream.quantization.int4_layouts import weight_shape_loader
from slipstream.quantization.utils import (
    check_checkpoint_method,
    load_time_weight,
    new_param,
    packed_shard_loader,
    quant_config_of,
    quantize_int8_per_channel,
    replace_param,
)

CHECKPOINT_CONFIG = {"quant_method": "int8_wo", "bits": 8, "weight_scale": "per_channel"}


class PerChannelMethod(QuantMethod):
    """Shared by int8_wo and fp8: weight [N, K] in one byte, weight_scale float32 [N]."""

    folds_norm = True  # quantized from the 16-bit weight at load: the fold goes in first

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None,
                    act) -> torch.Tensor:
        """Decode-size batches on CUDA: the dequant-GEMV computes act(gate_up) as it loads x
        (one launch less); anything else: apply(act(gate_up))."""
        m = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
        if gate_up.is_cuda and 0 < m <= _SMALL_M and _qlinear_small() is not None:
            return _qlinear_small()(gate_up, layer.weight, layer.weight_scale, bias, gated=True,
                                    act=act)
        return self.apply(layer, act(gate_up), bias)

    def apply_gate_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       rms_eps: float = 0.0) -> torch.Tensor | None:
        if not x.is_cuda or _qlinear_small() is None or not self._one_row_gemv_applies(x):
            return None
        from slipstream.kernels.gemv.int8 import qlinear_small_gate_out  # Triton: CUDA only

        return qlinear_small_gate_out(x, layer.weight, layer.weight_scale, bias, rms_eps)

    def apply_rms(self, layer: nn.Module, x: torch.Tensor, eps: float,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
        if not x.is_cuda or _qlinear_small() is None or not self._one_row_gemv_applies(x):
            return None
        from slipstream.kernels.gemv.int8 import qlinear_small_rms  # Triton: CUDA only

        return qlinear_small_rms(x, layer.weight, layer.weight_scale, bias, eps)

    def _one_row_gemv_applies(self, x: torch.Tensor) -> bool:
        """Whether apply(x) would run the one-row GEMV (subclasses with another path: False)."""
        return x.numel() == x.shape[-1]

    def checkpoint_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Fused tensors in checkpoint layout: leaf -> (tensor, output dim, pack factor)."""
        return {"weight": (layer.weight.data, 0, 1), "weight_scale": (layer.weight_scale.data, 0, 1)}


class Int8WeightOnlyMethod(PerChannelMethod):
    """weight int8 [N, K] (output_dim 0), weight_scale float32 [N]; y = (x @ q^T) * scale."""

    def __init__(self, prequantized: bool = False, ct_layout: Int8Layout | None = None):
        self.prequantized = prequantized
        self.ct_layout = ct_layout  # a compressed-tensors checkpoint's layout (None: slipstream's)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        n = sum(output_sizes)
        if self.ct_layout is not None:
            self._create_compressed(layer, input_size, output_sizes)
        elif self.prequantized:
            layer.register_parameter("weight", new_param(
                torch.empty(n, input_size, dtype=torch.int8), output_dim=0, input_dim=1))
            layer.register_parameter("weight_scale", new_param(
                torch.empty(n, dtype=torch.float32), output_dim=0))
        else:  # load the float checkpoint as usual (fused shards included), quantize after
            layer.register_parameter("weight", new_param(
                load_time_weight(n, input_size, params_dtype), output_dim=0, input_dim=1))

    def _create_compressed(self, layer: nn.Module, k: int, output_sizes: list[int]) -> None:
        """compressed-tensors: `weight` int8 [N, K] (pack-quantized: `weight_packed` int32
        [N, ceil(K/4)] and each module's `weight_shape`), `weight_scale` [N, 1] of any float dtype
        landing as float32 [N], static W8A8: one `input_scale` per module (loaded, unused)."""
        n, rows = sum(output_sizes), packed_shard_loader(output_sizes, 0)
        if self.ct_layout.packed:
            layer.register_parameter("weight_packed", new_param(
                torch.empty(n, -(-k // 4), dtype=torch.int32), weight_loader=rows))
            layer.register_parameter("weight_shape", new_param(
                torch.empty(len(output_sizes), 2, dtype=torch.int64),
                weight_loader=weight_shape_loader(output_sizes, k),
                dummy_value=torch.tensor([[size, k] for size in output_sizes])))
        else:
            layer.register_parameter("weight", new_param(
                torch.empty(n, k, dtype=torch.int8), output_dim=0, input_dim=1))
        layer.register_parameter("weight_scale", new_param(
            torch.empty(n, dtype=torch.float32), output_dim=0, weight_loader=rows))
        if self.ct_layout.static_input_scale:
            layer.register_parameter("input_scale", new_param(
                torch.empty(len(output_sizes), dtype=torch.float32),
                weight_loader=per_shard_scalar_loader))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if "weight_packed" in layer._parameters:
            k = int(layer.weight_shape.data[0, 1])
            q = unpack_int8_cols(layer.weight_packed.data, k)
            for name in ("weight_packed", "weight_shape"):
                del layer._parameters[name]
            replace_param(layer, "weight", q, output_dim=0, input_dim=1)
            return
        if self.prequantized or layer.weight.dtype == torch.int8:
            return
        q, scale = quantize_int8_per_channel(layer.weight.data)
        replace_param(layer, "weight", q, output_dim=0, input_dim=1)
        replace_param(layer, "weight_scale", scale, output_dim=0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


def unpack_int8_cols(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors pack-quantized 8-bit: int32 [N, ceil(K/4)] -> int8 [N, K]. Byte i of
    word j (lowest byte first) holds column 4j + i as value + 128 (pack_to_int32, num_bits 8)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = 8 * torch.arange(4, device=packed.device)
    unsigned = (words[..., None] >> shifts) & 0xFF
    return (unsigned.reshape(packed.shape[0], -1)[:, :k] - 128).to(torch.int8).contiguous()


def per_shard_scalar_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    """One scalar per fused shard (a static input_scale per checkpoint module)."""
    param.data[shard or 0] = loaded.reshape(-1)[0]


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (qweight * scale[:, None])^T (+ bias) in x's dtype."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if x.is_cuda and 0 < m <= _SMALL_M:
        small = _qlinear_small()
        if small is not None:
            return small(x, qweight, scale, bias)
    if x.is_cuda and m > _SMALL_M:
        large = _qlinear_large()
        if large is not None:
            return large(x, qweight, scale, bias)
    if x.device.type == "cpu" and 0 < m <= _CPU_PACKED_MAX_M and _HAS_INT8PACK_MM:
        return int8pack_linear(x, qweight, scale, bias)
    return convert_linear(x, qweight, scale, bias)


def int8pack_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """CPU: torch's INT8-weight GEMM (scales per output channel), fast with bf16 activations
    (float32 ones take a slow path): x and the scales rounded to bf16, the result back in x's
    dtype; no [N, K] float temporary."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch._weight_int8pack_mm(x2, qweight.contiguous(), scale.to(torch.bfloat16))
    out = out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
    return out if bias is None else out + bias


def convert_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Convert the whole weight to x's dtype (INT8 values are exact there; a temporary [N, K]),
    F.linear, then scale the output: the CPU path above int8pack_linear's rows, and on CUDA the
    cuBLAS alternative the large-M tuner measures (kernels/gemm/int8.py)."""
    out = F.linear(x, qweight.to(x.dtype))
    out = out * scale.to(out.dtype)
    return out if bias is None else out + bias


_SMALL_M = 16
# CPU rows up to which int8pack_linear beats convert_linear (one thread, SmolLM2's layers and
# LM head: faster at 1 and 8 rows, slower at 128)
_CPU_PACKED_MAX_M = 8
_HAS_INT8PACK_MM = hasattr(torch, "_weight_int8pack_mm")


@functools.cache
def _kernel(module: str, name: str):
    """slipstream.kernels.<module>.<name>, or None when Triton cannot load (torch is used)."""
    try:
        return getattr(importlib.import_module(f"slipstream.kernels.{module}"), name)
    except ImportError:
        return None


def _qlinear_small():
    """kernels.gemv.int8.qlinear_small (at most _SMALL_M rows), or None."""
    return _kernel("gemv.int8", "qlinear_small")


def _qlinear_large():
    """kernels.gemm.int8.int8_linear_large (more rows), or None."""
    return _kernel("gemm.int8", "int8_linear_large")


@register_quant_method("int8_wo")
def make_int8_wo(hf_config: dict):
    prequantized = check_checkpoint_method("int8_wo", hf_config)
    return method_factory(Int8WeightOnlyMethod, prequantized, hf_config)


def method_factory(cls: type[Int8WeightOnlyMethod], prequantized: bool, hf_config: dict):
    """prefix -> method, for int8_wo and w8a8_sq: a compressed-tensors checkpoint keeps the layers
    outside its targets or in its `ignore` list float."""
    qc = quant_config_of(hf_config)
    if not (prequantized and compressed_tensors.is_compressed_tensors(qc)):
        return lambda prefix: cls(prequantized)
    quantized, layout = compressed_tensors.int8_layer_filter(hf_config, qc)

    def method_for(prefix: str) -> QuantMethod:
        return cls(True, layout) if quantized(prefix) else UnquantizedLinearMethod()

    return method_for


def make_method() -> Int8WeightOnlyMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`)."""
    return Int8WeightOnlyMethod(prequantized=False)


def checkpoint_config() -> dict:
    return dict(CHECKPOINT_CONFIG)
