"""fp8: W8A8 with FP8 E4M3 weights (per-channel scales) and dynamic per-token FP8 activations.

Large batches run torch._scaled_mm (row-wise scales); decode-size batches stream the FP8 weight
through the Triton dequant-GEMV with bf16 activations (same bytes, cuBLAS FP8 is slow at M=1).
Loads HF FP8 checkpoints (`quant_method: fp8`) with per-tensor, per-channel or block-wise weight
scales (blocks requantized per channel at load) and layers left float by `modules_to_not_convert` /
`ignored_layers`; Meta's `fbgemm_fp8` checkpoints (per-channel); and compressed-tensors FP8
checkpoints (llm-compressor "FP8" / "FP8-dynamic": compressed_tensors.py).
"""
from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.activation import SiluAndMul
from slipstream.layers.norm import RMSNorm
from slipstream.quantization import compressed_tensors
from slipstream.quantization.base import QuantMethod, UnquantizedLinearMethod, register_quant_method
from slipstream.quantization.int8_wo import _SMALL_M, PerChannelMethod, _qlinear_small
from slipstream.quantization.utils import (
    FP8_DTYPE,
    check_checkpoint_method,
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
                 unused_checkpoint_tensors: tuple[str, ...] = ()):
        self.prequantized = prequantized
        self.static_input_scale = static_input_scale
        self.block_size = block_size  # (rows, cols) of a block-wise checkpoint's weight_scale_inv
        # Leaf names of per-layer checkpoint tensors this method reads nothing from (fbgemm's
        # input_scale_ub): a loader may skip them.
        self.unused_checkpoint_tensors = unused_checkpoint_tensors

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        check_fp8_device(torch.empty(0).device)  # the device the model is being built on
        n = sum(output_sizes)
        if not self.prequantized:
            layer.register_parameter("weight", new_param(
                torch.empty(n, input_size, dtype=params_dtype), output_dim=0, input_dim=1))
            return
        layer.register_parameter("weight", new_param(
            torch.empty(n, input_size, dtype=FP8_DTYPE), output_dim=0, input_dim=1))
        if self.block_size is not None:
            _create_block_scales(layer, input_size, output_sizes, self.block_size)
        else:
            # Per-tensor checkpoint scales (one per q/k/v shard) broadcast over the shard's rows.
            layer.register_parameter("weight_scale", new_param(
                torch.empty(n, dtype=torch.float32), output_dim=0,
                weight_loader=packed_shard_loader(output_sizes, 0, broadcast_scalar=True)))
        if self.static_input_scale:  # accepted, unused: activation scales are computed per token
            layer.register_parameter("input_scale", new_param(
                torch.empty(len(output_sizes), dtype=torch.float32),
                weight_loader=_per_shard_scalar_loader))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if "weight_scale_inv" in layer._parameters:
            requantize_blocks_per_channel(layer, self.block_size)
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


def _create_block_scales(layer: nn.Module, input_size: int, output_sizes: list[int],
                         block_size: tuple[int, int]) -> None:
    """weight_scale_inv float32 [sum of each shard's ceil(n / rows), ceil(K / cols)]: a fused
    layer's shards each bring their own block rows (the last one may be partial)."""
    block_rows = [_ceil_div(n, block_size[0]) for n in output_sizes]
    shape = (sum(block_rows), _ceil_div(input_size, block_size[1]))
    layer.register_parameter("weight_scale_inv", new_param(
        torch.empty(shape, dtype=torch.float32),
        weight_loader=_block_scale_loader(block_rows, block_size)))


def _block_scale_loader(block_rows: list[int], block_size: tuple[int, int]) -> Callable:
    load = packed_shard_loader(block_rows, 0)

    def load_block_scales(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        try:
            load(param, loaded, shard)
        except ValueError as e:  # most likely the config's block size is not the tensors'
            raise ValueError(f"{e} (weight_block_size {list(block_size)})") from None

    return load_block_scales


@torch.no_grad()
def requantize_blocks_per_channel(layer: nn.Module, block_size: tuple[int, int],
                                  chunk_rows: int = 1024) -> None:
    """Block-scaled fp8 weight -> the per-channel layout: dequantize each block, requantize each
    output row (in place, chunk by chunk: peak extra memory is a few chunks in float32)."""
    weight, scale_inv = layer.weight.data, layer.weight_scale_inv.data
    rows_per_block = block_size[0]
    chunk_rows = max(1, chunk_rows // rows_per_block) * rows_per_block  # whole block rows
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    row = block_row = 0
    for n in layer.output_sizes:  # each fused shard's blocks start at its own first row
        for start in range(0, n, chunk_rows):
            stop = min(start + chunk_rows, n)
            blocks = scale_inv[block_row + start // rows_per_block:
                               block_row + _ceil_div(stop, rows_per_block)]
            w = dequantize_blockwise(weight[row + start:row + stop], blocks, block_size)
            q, chunk_scale = quantize_fp8_per_channel(w)
            weight[row + start:row + stop] = q
            scale[row + start:row + stop] = chunk_scale
        row += n
        block_row += _ceil_div(n, rows_per_block)
    del layer._parameters["weight_scale_inv"]
    replace_param(layer, "weight_scale", scale, output_dim=0)


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int]) -> torch.Tensor:
    """q [R, K] times its block's scale: scale_inv [ceil(R / rows), ceil(K / cols)] -> float32."""
    r, k = q.shape
    per_element = (scale_inv.float().repeat_interleave(block_size[0], dim=0)[:r]
                   .repeat_interleave(block_size[1], dim=1)[:, :k])
    return q.float() * per_element


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _per_shard_scalar_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    param.data[shard or 0] = loaded.reshape(-1)[0]


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
    # engines run: 5-15% faster at W2 shapes (bench_scaled_mm.py, H200).
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=True)


def _quantized_linear(xq: torch.Tensor, x_scale: torch.Tensor, layer: nn.Module,
                      bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The layer's output for activations its caller already quantized per token."""
    out = _scaled_mm_quantized(xq, x_scale, layer.weight, layer.weight_scale).to(dtype)
    return out if bias is None else out + bias


def _fused_norm_quant():
    """kernels.quant_act.rms_norm_quant_fp8, or None when Triton cannot load."""
    try:
        from slipstream.kernels.quant_act import rms_norm_quant_fp8
    except ImportError:
        return None
    return rms_norm_quant_fp8


def _fused_silu_quant():
    """kernels.quant_act.silu_and_mul_quant_fp8, or None when Triton cannot load."""
    try:
        from slipstream.kernels.quant_act import silu_and_mul_quant_fp8
    except ImportError:
        return None
    return silu_and_mul_quant_fp8


def _quantize_per_token_cuda(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch Triton quantizer when Triton loads, else the torch twin."""
    try:
        from slipstream.kernels.quant_act import quantize_per_token_fp8
    except ImportError:
        return quantize_per_token(x2, FP8_DTYPE)
    return quantize_per_token_fp8(x2)


def fp8_linear_reference(x2: torch.Tensor, qweight: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    """The oracle: quantize x per token to FP8, then float32 math on the dequantized operands."""
    xq, x_scale = quantize_per_token(x2, FP8_DTYPE)
    return F.linear(xq.float() * x_scale, qweight.float() * scale.float()[:, None])


def _every_layer(prefix: str) -> bool:
    return True


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint's fp8 layers are stored (the defaults: a float checkpoint to quantize)."""

    quantized: Callable[[str], bool] = _every_layer  # layer prefix -> stored in fp8?
    static_input_scale: bool = False
    block_size: tuple[int, int] | None = None  # weight_scale_inv per [rows, cols] block
    unused_tensors: tuple[str, ...] = ()  # per-layer checkpoint tensors nothing reads


@register_quant_method("fp8")
def make_fp8(hf_config: dict):
    prequantized = check_checkpoint_method("fp8", hf_config)
    qc = quant_config_of(hf_config)
    if not prequantized:
        layout = Fp8Layout()
    elif compressed_tensors.is_compressed_tensors(qc):
        # Layers in the checkpoint's `ignore` list (or no group's target) stay float.
        layout = Fp8Layout(*compressed_tensors.fp8_layer_filter(hf_config, qc))
    else:
        layout = hf_fp8_layout(hf_config, qc)

    def method_for(prefix: str) -> QuantMethod:
        if not layout.quantized(prefix):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(prequantized, layout.static_input_scale, layout.block_size,
                               layout.unused_tensors)

    return method_for


# --- HF `quant_method: fp8` / `fbgemm_fp8` checkpoints ---------------------------------------------

FBGEMM_METHOD = "fbgemm_fp8"


def hf_fp8_layout(hf_config: dict, qc: dict) -> Fp8Layout:
    """The layout of an HF `fp8` (AutoFP8, Qwen3 / DeepSeek FP8) or `fbgemm_fp8` checkpoint."""
    quantized = not_converted_filter(not_converted_modules(qc),
                                     compressed_tensors.packed_modules_of(hf_config))
    if str(qc.get("quant_method", "")).lower() == FBGEMM_METHOD:
        if qc.get("activation_scale_ub") is not None:
            # Honouring it would thread a clamp through every activation quantizer (torch and
            # Triton); unclamped per-token scales only differ on tokens whose amax exceeds it.
            logger.info("fbgemm_fp8 checkpoint: per-channel weights, dynamic per-token "
                        "activations; activation_scale_ub=%s is not applied",
                        qc["activation_scale_ub"])
        # Per-channel weights, dynamic activations; a stored input_scale_ub is the bound above.
        return Fp8Layout(quantized, unused_tensors=("input_scale_ub",))
    static = qc.get("activation_scheme", "dynamic") == "static"
    return Fp8Layout(quantized, static, weight_block_size(qc))


def weight_block_size(qc: dict) -> tuple[int, int] | None:
    """`weight_block_size` [rows, cols] of a block-wise checkpoint (None: per tensor / channel)."""
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols] of positive "
                         f"integers, got {block!r}")
    # Once per load: the fp8 kernels take one scale per output channel, not per block.
    logger.warning("FP8 checkpoint with weight_block_size %s: block scales are requantized per "
                   "output channel at load (a second FP8 rounding: a small extra weight error)",
                   list(block))
    return int(block[0]), int(block[1])


def not_converted_modules(qc: dict) -> tuple[str, ...]:
    """Module names the checkpoint left float: HF's `modules_to_not_convert`, vLLM / AutoFP8's
    `ignored_layers` (both honoured when both are given)."""
    names = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        listed = qc.get(key) or []
        if isinstance(listed, str) or not all(isinstance(n, str) for n in listed):
            raise ValueError(f"quantization_config.{key} must be a list of module names, "
                             f"got {listed!r}")
        names.extend(listed)
    return tuple(names)


def not_converted_filter(not_converted: tuple[str, ...], packed: dict[str, list[str]]
                         ) -> Callable[[str], bool]:
    """prefix of a slipstream linear layer -> whether the checkpoint quantized it.

    A fused layer (qkv_proj) is float when all its checkpoint modules (q/k/v_proj) are listed,
    or the fused name itself is; listing only some is an error (they share one weight here).
    """
    def quantized(prefix: str) -> bool:
        names = compressed_tensors.checkpoint_module_names(prefix, packed)
        if len(names) > 1 and is_listed(prefix, not_converted):
            return False
        floats = [is_listed(name, not_converted) for name in names]
        if all(floats) or not any(floats):
            return not floats[0]
        split = ", ".join(f"{n}: {'float' if f else 'fp8'}" for n, f in zip(names, floats))
        raise ValueError(f"FP8 checkpoint leaves only some of the modules fused into {prefix} "
                         f"float ({split}; modules_to_not_convert / ignored_layers); they share "
                         "one weight here, so list all of them or none")

    return quantized


def is_listed(name: str, entries: tuple[str, ...]) -> bool:
    """Whether an entry names module `name` or a module around it, in whole dotted parts: the
    full name, a prefix ("model.layers.1", which is not one of "model.layers.10..."), a tail
    ("down_proj") or a run in between ("self_attn"); `*` matches any characters (fnmatch)."""
    dotted = f".{name}."
    return any(fnmatch.fnmatchcase(name, e) or fnmatch.fnmatchcase(name, f"{e}.*") if "*" in e
               else f".{e.strip('.')}." in dotted for e in entries)


def make_method() -> Fp8LinearMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`)."""
    return Fp8LinearMethod(prequantized=False)


def checkpoint_config() -> dict:
    return dict(CHECKPOINT_CONFIG)
