"""fp8: W8A8 with FP8 E4M3 weights (per-channel scales) and dynamic per-token FP8 activations.

Large batches run torch._scaled_mm (row-wise scales); decode-size batches stream the FP8 weight
through the Triton dequant-GEMV with bf16 activations (same bytes, cuBLAS FP8 is slow at M=1).
Loads HF FP8 checkpoints (`quant_method: fp8`) with per-tensor, per-channel or block-wise weight
scales (blocks requantized per channel at load) and layers left float by `modules_to_not_convert` /
`ignored_layers`; Meta's `fbgemm_fp8` checkpoints (per-channel) (both: fp8_layouts.py); and
compressed-tensors FP8 checkpoints (llm-compressor "FP8" / "FP8-dynamic": compressed_tensors.py).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.activation import SiluAndMul
from slipstream.layers.norm import RMSNorm
from slipstream.quantization import compressed_tensors
from slipstream.quantization.base import QuantMethod, UnquantizedLinearMethod, register_quant_method
from slipstream.quantization.fp8_layouts import (
    Fp8Layout,
    create_block_scales,
    hf_fp8_layout,
    requantize_blocks_per_channel,
)
from slipstream.quantization.int8_wo import (
    _SMALL_M,
    PerChannelMethod,
    _qlinear_small,
    per_shard_scalar_loader,
)
from slipstream.quantization.utils import (
    FP8_DTYPE,
    check_checkpoint_method,
    load_time_weight,
    new_param,
    packed_shard_loader,
    quant_config_of,
    quantize_fp8_per_channel,
    quantize_per_token,
    replace_param,
)

logger = logging.getLogger(__name__)

CHECKPOINT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_scale": "per_channel"}
MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """FP8 matmuls need compute capability 8.9+ (Ada / Hopper): say so instead of failing later."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"quantization='fp8' needs a GPU of compute capability >= 8.9; "
                           f"{name} has {cap[0]}.{cap[1]} (use 'int8_wo' or no quantization)")


class Fp8LinearMethod(PerChannelMethod):
    """weight fp8 [N, K], weight_scale float32 [N]; activations quantized per token at run time."""

    def __init__(self, prequantized: bool = False, static_input_scale: bool = False,
                 block_size: tuple[int, int] | None = None,
                 unused_checkpoint_tensors: tuple[str, ...] = (),
                 block_scale_name: str = "weight_scale_inv"):
        self.prequantized = prequantized
        self.static_input_scale = static_input_scale
        self.block_size = block_size  # (rows, cols) of a block-wise checkpoint's scales
        self.block_scale_name = block_scale_name  # their name in the checkpoint
        # Leaf names of per-layer checkpoint tensors this method reads nothing from (fbgemm's
        # input_scale_ub): a loader may skip them.
        self.unused_checkpoint_tensors = unused_checkpoint_tensors

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        check_fp8_device(torch.empty(0).device)  # the device the model is being built on
        n = sum(output_sizes)
        if not self.prequantized:
            layer.register_parameter("weight", new_param(
                load_time_weight(n, input_size, params_dtype), output_dim=0, input_dim=1))
            return
        layer.register_parameter("weight", new_param(
            torch.empty(n, input_size, dtype=FP8_DTYPE), output_dim=0, input_dim=1))
        if self.block_size is not None:
            create_block_scales(layer, input_size, output_sizes, self.block_size,
                                self.block_scale_name)
        else:
            # Per-tensor checkpoint scales (one per q/k/v shard) broadcast over the shard's rows.
            layer.register_parameter("weight_scale", new_param(
                torch.empty(n, dtype=torch.float32), output_dim=0,
                weight_loader=packed_shard_loader(output_sizes, 0, broadcast_scalar=True)))
        if self.static_input_scale:  # accepted, unused: activation scales are computed per token
            layer.register_parameter("input_scale", new_param(
                torch.empty(len(output_sizes), dtype=torch.float32),
                weight_loader=per_shard_scalar_loader))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if self.prequantized and self.block_size is not None:
            requantize_blocks_per_channel(layer, self.block_size, name=self.block_scale_name)
            return
        if layer.weight.dtype == FP8_DTYPE:
            return
        q, scale = quantize_fp8_per_channel(layer.weight.data)
        replace_param(layer, "weight", q, output_dim=0, input_dim=1)
        replace_param(layer, "weight_scale", scale, output_dim=0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None,
                    act) -> torch.Tensor:
        """Large batches on CUDA: one kernel computes silu(gate) * up and its per-token FP8
        quantization for torch._scaled_mm (same values as silu_and_mul, then the quantizer)."""
        fused = _fused_silu_quant()
        k2 = gate_up.shape[-1]
        m = gate_up.numel() // k2 if k2 else 0
        w = layer.weight
        if (fused is None or not gate_up.is_cuda or m <= _SMALL_M or not isinstance(act, SiluAndMul)
                or (k2 // 2) % 16 or w.shape[0] % 16):
            return super().apply_gated(layer, gate_up, bias, act)
        xq, x_scale = fused(gate_up.reshape(m, k2))
        out = _quantized_linear(xq, x_scale, layer, bias, gate_up.dtype)
        return out.reshape(*gate_up.shape[:-1], w.shape[0])

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: nn.Module, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Large batches on CUDA: one kernel adds the residual, normalises and quantizes per
        token (the same values as the norm kernel, then the quantizer; the bf16 input of
        torch._scaled_mm is never written)."""
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        w = layer.weight
        fused = _fused_norm_quant()
        if (fused is None or not x.is_cuda or m <= _SMALL_M or k % 16 or w.shape[0] % 16
                or x.dim() != 2 or not isinstance(norm, RMSNorm)
                or layer._forward_hooks or layer._forward_pre_hooks):  # hooks want the input
            return super().apply_normed(layer, x, residual, norm, bias)
        xq, x_scale, new_residual = fused(x, norm.weight, norm.eps, residual)
        out = _quantized_linear(xq, x_scale, layer, bias, x.dtype)
        return out, (x if new_residual is None else new_residual)


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (qweight * scale)^T (+ bias); W8A8 with per-token activation scales."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], qweight.shape[0]
    if x.is_cuda and 0 < m <= _SMALL_M and _qlinear_small() is not None:
        return _qlinear_small()(x, qweight, scale, bias)
    if x.is_cuda and k % 16 == 0 and n % 16 == 0 and m > 0:
        out = _scaled_mm_linear(x2, qweight, scale)
    else:
        out = fp8_linear_reference(x2, qweight, scale)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def _scaled_mm_linear(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, x_scale = _quantize_per_token_cuda(x2)
    return _scaled_mm_quantized(xq, x_scale, qweight, scale)


def _scaled_mm_quantized(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    # Row-wise scaling: scale_a [M, 1], scale_b [1, N], both float32; weight^T is column-major.
    # Fast accumulation (no periodic promotion to float32 on Hopper), as the FP8 GEMMs of other
    # engines run; faster at batched-decode shapes (benchmarks/bench_scaled_mm.py).
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=True)


def _quantized_linear(xq: torch.Tensor, x_scale: torch.Tensor, layer: nn.Module,
                      bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The layer's output for activations its caller already quantized per token."""
    out = _scaled_mm_quantized(xq, x_scale, layer.weight, layer.weight_scale).to(dtype)
    return out if bias is None else out + bias


def _fused_norm_quant():
    """kernels.norm_act.quant_act.rms_norm_quant_fp8, or None when Triton cannot load."""
    try:
        from slipstream.kernels.norm_act.quant_act import rms_norm_quant_fp8  # Triton: optional
    except ImportError:
        return None
    return rms_norm_quant_fp8


def _fused_silu_quant():
    """kernels.norm_act.quant_act.silu_and_mul_quant_fp8, or None when Triton cannot load."""
    try:
        from slipstream.kernels.norm_act.quant_act import silu_and_mul_quant_fp8  # Triton: optional
    except ImportError:
        return None
    return silu_and_mul_quant_fp8


def _quantize_per_token_cuda(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch Triton quantizer when Triton loads, else the torch twin."""
    try:
        from slipstream.kernels.norm_act.quant_act import quantize_per_token_fp8  # Triton: optional
    except ImportError:
        return quantize_per_token(x2, FP8_DTYPE)
    return quantize_per_token_fp8(x2)


def fp8_linear_reference(x2: torch.Tensor, qweight: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    """The oracle: quantize x per token to FP8, then float32 math on the dequantized operands."""
    xq, x_scale = quantize_per_token(x2, FP8_DTYPE)
    return F.linear(xq.float() * x_scale, qweight.float() * scale.float()[:, None])


@register_quant_method("fp8")
def make_fp8(hf_config: dict):
    prequantized = check_checkpoint_method("fp8", hf_config)
    qc = quant_config_of(hf_config)
    if not prequantized:
        layout = Fp8Layout()
    elif compressed_tensors.is_compressed_tensors(qc):
        # Layers in the checkpoint's `ignore` list (or no group's target) stay float.
        quantized, static, block = compressed_tensors.fp8_layer_filter(hf_config, qc)
        layout = Fp8Layout(quantized, static, block, block_scale_name="weight_scale")
    else:
        layout = hf_fp8_layout(hf_config, qc)

    def method_for(prefix: str) -> QuantMethod:
        if not layout.quantized(prefix):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(prequantized, layout.static_input_scale, layout.block_size,
                               layout.unused_tensors, layout.block_scale_name)

    return method_for


def make_method(keep_float: int = 0) -> Fp8LinearMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`)."""
    return Fp8LinearMethod(prequantized=False)


def float_layers(llm, texts: list[str], max_len: int, keep_float: int) -> list[str]:
    """`slipstream quantize --keep-float N`: the module paths of the N projections whose FP8
    rounding disturbs the float model most on the calibration texts (fp8_calibration.py)."""
    from slipstream.quantization.calibration import calibration_prompts
    from slipstream.quantization.fp8_calibration import measure_sensitivity, most_sensitive

    cfg = llm.engine_config
    prompts = calibration_prompts(llm.tokenizer, texts, max_len, cfg.model.vocab_size)
    scores = measure_sensitivity(llm.engine.runner.model, prompts)
    chosen = most_sensitive(scores, keep_float)
    logger.info("fp8: keeping %d of %d projections in 16 bits: %s", len(chosen), len(scores),
                ", ".join(chosen))
    return chosen


def checkpoint_config(keep_float: int = 0) -> dict:
    return dict(CHECKPOINT_CONFIG)
