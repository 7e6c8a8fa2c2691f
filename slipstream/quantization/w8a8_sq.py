"""w8a8_sq: SmoothQuant W8A8, INT8 per-output-channel weights and INT8 dynamic per-token inputs.

`slipstream quantize --method w8a8_sq` migrates activation outliers into the weights with
s_j = max|X_j|^alpha / max|W_j|^(1-alpha), folded into the op before each projection; at load
time without calibration data it is plain per-channel W8A8. GPU: torch._int_mm (INT32 accumulate).
Also loads compressed-tensors INT8 W8A8 checkpoints (llm-compressor "W8A8"; int8_wo.method_factory).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.quantize_as_loaded import layer_hook_active
from slipstream.quantization import utils as qu
from slipstream.quantization.awq import layer_inputs
from slipstream.quantization.base import register_quant_method
from slipstream.quantization.int8_wo import Int8WeightOnlyMethod, method_factory

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.5
NEEDS_CALIBRATION = True
_INT_MM_MIN_M = 17  # torch._int_mm needs M > 16, K and N multiples of 8
_EXACT_K = 1024  # 1024 * 127 * 127 < 2**24: a float32 dot of this many int8 pairs is exact
_SCALE_RANGE = (1e-5, 1e5)


class W8A8SmoothQuantMethod(Int8WeightOnlyMethod):
    """Same stored layout as int8_wo (weight int8 [N, K], weight_scale float32 [N]); the input is
    quantized per token too, so the matmul runs on INT8 operands."""

    folds_norm = False  # SmoothQuant's migration scales live in the norms

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_linear(x, layer.weight, layer.weight_scale, bias)

    def _one_row_gemv_applies(self, x: torch.Tensor) -> bool:
        return False  # its products take INT8 activations; the one-row GEMV takes bf16


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """y = (q_x @ q_w^T) * x_scale * w_scale (+ bias) in x's dtype; q_x per-token INT8."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    n = qweight.shape[0]
    xq, x_scale = qu.quantize_per_token(x2, torch.int8)
    acc = int8_matmul(xq, qweight)
    out = (acc.float() * x_scale * w_scale.float()[None, :]).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def int8_matmul(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] @ qweight int8 [N, K]^T -> int32 [M, N], exact on every path."""
    m, k = xq.shape
    n = qweight.shape[0]
    if xq.is_cuda and m > 0 and k % 8 == 0 and n % 8 == 0:
        if m < _INT_MM_MIN_M:  # zero rows are free to add and keep the INT8 semantics
            xq = F.pad(xq, (0, 0, 0, _INT_MM_MIN_M - m))
        # qweight.t() is column-major [K, N]: the layout cuBLASLt's INT8 GEMM wants.
        return torch._int_mm(xq, qweight.t())[:m]
    return int8_matmul_reference(xq, qweight)


def int8_matmul_reference(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """The oracle: float32 math on integer values in K-chunks small enough to be exact."""
    m, k = xq.shape
    acc = torch.zeros(m, qweight.shape[0], dtype=torch.int32, device=xq.device)
    for start in range(0, k, _EXACT_K):
        xs = xq[:, start:start + _EXACT_K].float()
        ws = qweight[:, start:start + _EXACT_K].float()
        acc += F.linear(xs, ws).to(torch.int32)
    return acc


# --- SmoothQuant migration ------------------------------------------------------------------------

def smooth_scales(act_absmax: torch.Tensor, weight: torch.Tensor,
                  alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha) per input channel j of weight [N, K].

    Dead channels (no activation or no weight seen) keep s = 1; the rest is clamped so that a
    rare channel cannot blow the folded norm weight up.
    """
    x_max = act_absmax.float().to(weight.device)
    w_max = weight.float().abs().amax(dim=0)
    s = x_max.clamp_min(1e-12).pow(alpha) / w_max.clamp_min(1e-12).pow(1.0 - alpha)
    s = torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))
    return s.clamp(*_SCALE_RANGE)


@torch.no_grad()
def prepare_for_quantization(model: nn.Module, stats: dict, alpha: float = DEFAULT_ALPHA) -> None:
    """Fold SmoothQuant scales from the calibration stats (input absmax per linear layer)."""
    _check_alpha(alpha)
    qu.fold_input_scales(
        model, lambda name, linear: smooth_scales(stats[name].absmax, linear.weight.data, alpha))


class LayerByLayerSmoothQuant:
    """SmoothQuant one decoder layer at a time, in order (a models.quantize_as_loaded layer
    hook, as awq.LayerByLayerAwq): each calibration prompt's float residual stream is kept
    between layers, layer i's projection inputs give the per-channel absmax, and the scales
    are folded into layer i before it is quantized. The same statistics as running the prompts
    through the loaded float model (collect_linear_stats), up to float rounding, without ever
    holding that model."""

    def __init__(self, prompts: list[list[int]], alpha: float = DEFAULT_ALPHA):
        _check_alpha(alpha)
        self.prompts, self.alpha = prompts, alpha
        self.next_layer = 0
        self._h: list[torch.Tensor] | None = None  # per prompt [1, T, hidden] float32

    @torch.no_grad()
    def __call__(self, model: nn.Module, index: int, layer: nn.Module) -> None:
        if index != self.next_layer:
            raise RuntimeError(f"SmoothQuant: decoder layer {index} arrived before layer "
                               f"{self.next_layer} (layers must be calibrated in order)")
        cos_sin = model.model.rotary_emb.cos_sin_cache.float()
        if self._h is None:
            embed = model.model.embed_tokens
            self._h = [embed(torch.tensor([p], device=embed.weight.device)).float()
                       for p in self.prompts]
        absmax: dict[str, torch.Tensor] = {}
        for i, h in enumerate(self._h):
            inp, self._h[i] = layer_inputs(layer, h, cos_sin)
            for name, x in (("self_attn.qkv_proj", inp.attn_in), ("self_attn.o_proj", inp.ctx),
                            ("mlp.gate_up_proj", inp.mlp_in), ("mlp.down_proj", inp.act)):
                m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
                absmax[name] = torch.maximum(absmax[name], m) if name in absmax else m
        prefix = f"model.layers.{index}"
        qu.fold_layer_input_scales(layer, prefix, lambda name, linear: smooth_scales(
            absmax[name.removeprefix(prefix + ".")], linear.weight.data, self.alpha))
        self.next_layer += 1


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"w8a8_sq: alpha must be in [0, 1], got {alpha}")


# --- registration ---------------------------------------------------------------------------------

@register_quant_method("w8a8_sq")
def make_w8a8_sq(hf_config: dict):
    prequantized = qu.check_checkpoint_method("w8a8_sq", hf_config)
    if not prequantized and not layer_hook_active():  # `slipstream quantize` calibrates in the load
        logger.warning("w8a8_sq at load time has no calibration data, so no SmoothQuant "
                       "migration: plain per-channel INT8 W8A8. Run `slipstream quantize --method "
                       "w8a8_sq` for the smoothed checkpoint")
    return method_factory(W8A8SmoothQuantMethod, prequantized, hf_config)


def make_method(alpha: float = DEFAULT_ALPHA) -> W8A8SmoothQuantMethod:
    """A method that quantizes a loaded (already smoothed) float weight (`slipstream quantize`)."""
    return W8A8SmoothQuantMethod(prequantized=False)


def checkpoint_config(alpha: float = DEFAULT_ALPHA) -> dict:
    return {"quant_method": "w8a8_sq", "bits": 8, "weight_scale": "per_channel",
            "activation_scheme": "dynamic_per_token", "smoothquant_alpha": alpha}
