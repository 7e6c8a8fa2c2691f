"""Which linear layers an FP8 checkpoint keeps in 16 bits: measured on calibration data.

FP8 E4M3 keeps 3 mantissa bits whatever the scale, so finer scales buy little; what differs is
how much each projection's rounding (weight per channel, input per token) disturbs the model.
`slipstream quantize --method fp8 --keep-float N` runs the calibration prompts through the float
model one decoder layer at a time and scores each projection's FP8 rounding (weight per
channel, input per token: the fp8 method's own arithmetic, as a torch fake-quant) by how much it
changes its layer's output stream (measure_sensitivity). The N projections that change it most
stay float;
their Hugging Face module names go into the checkpoint's `ignored_layers`, which the fp8 loader
honours (fp8_layouts.not_converted_modules).
"""
from __future__ import annotations

import logging
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization import utils as qu
from slipstream.quantization.awq import attention_ctx, gated_act

logger = logging.getLogger(__name__)

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] as the fp8 method multiplies by it: per-channel E4M3, dequantized (float32)."""
    q, scale = qu.quantize_fp8_per_channel(w)
    return qu.dequantize_per_channel(q, scale)


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the fp8 method sees it: per-token E4M3, dequantized (float32)."""
    q, scale = qu.quantize_per_token(x.reshape(-1, x.shape[-1]), qu.FP8_DTYPE)
    return (q.float() * scale).reshape(x.shape)


def _linear(x: torch.Tensor, linear: nn.Module, quantized: bool) -> torch.Tensor:
    w = linear.weight.float()
    if not quantized:
        return F.linear(x, w, _bias(linear))
    return F.linear(fake_quant_tokens(x), fake_quant_weight(w), _bias(linear))


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.float()


def layer_forward(layer: nn.Module, h: torch.Tensor, cos_sin: torch.Tensor,
                  quantized: Collection[str] = ()) -> torch.Tensor:
    """One float Llama decoder layer on the residual stream h [B, T, H], with the projections
    named in `quantized` (of PROJECTIONS) in FP8 W8A8 fake-quant; the stream after it."""
    attn, mlp = layer.self_attn, layer.mlp
    x = layer.input_layernorm(h)
    w_qkv = attn.qkv_proj.weight.float()
    if PROJECTIONS[0] in quantized:
        x, w_qkv = fake_quant_tokens(x), fake_quant_weight(w_qkv)
    ctx = attention_ctx(attn, x, w_qkv, cos_sin)
    h = h + _linear(ctx, attn.o_proj, PROJECTIONS[1] in quantized)
    x = layer.post_attention_layernorm(h)
    w_gate_up = mlp.gate_up_proj.weight.float()
    if PROJECTIONS[2] in quantized:
        x, w_gate_up = fake_quant_tokens(x), fake_quant_weight(w_gate_up)
    act = gated_act(mlp, x, w_gate_up)
    return h + _linear(act, mlp.down_proj, PROJECTIONS[3] in quantized)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over tokens of |got - want|^2 / |want|^2 (each token counts alike, whatever its norm:
    a few tokens carry residual streams far larger than the rest)."""
    err = (got - want).float().pow(2).sum(-1)
    ref = want.float().pow(2).sum(-1).clamp_min(1e-30)
    return (err / ref).mean().item()


@torch.no_grad()
def measure_sensitivity(model: nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """{projection module path (model.layers.i.mlp.down_proj): its FP8 sensitivity} for a loaded
    float Llama-family model on the calibration prompts: the relative_error of its decoder
    layer's output when that projection alone runs in FP8, on the float residual stream.
    One pass over the layers (five layer forwards each): cheap enough for a CPU."""
    _check_llama_layers(model)
    cos_sin = model.model.rotary_emb.cos_sin_cache.float()
    embed = model.model.embed_tokens
    scores: dict[str, float] = {}
    streams = [embed(torch.tensor([p], device=embed.weight.device)).float() for p in prompts]
    for i, layer in enumerate(model.model.layers):
        for j, h in enumerate(streams):
            streams[j] = want = layer_forward(layer, h, cos_sin)
            for name in PROJECTIONS:
                err = relative_error(layer_forward(layer, h, cos_sin, (name,)), want)
                key = f"model.layers.{i}.{name}"
                scores[key] = scores.get(key, 0.0) + err / len(prompts)
    return scores


def _check_llama_layers(model: nn.Module) -> None:
    for layer in model.model.layers:
        if not all(hasattr(layer.get_submodule(p.split(".")[0]), p.split(".")[1])
                   for p in PROJECTIONS):
            raise ValueError("fp8 --keep-float measures Llama-family decoder layers (q/k/v, o, "
                             f"gate/up, down); {type(model).__name__} has others")


def most_sensitive(scores: dict[str, float], count: int) -> list[str]:
    """The `count` module paths of largest score, in model order."""
    if count < 0:
        raise ValueError(f"keep_float must be >= 0, got {count}")
    chosen = set(sorted(scores, key=scores.__getitem__, reverse=True)[:count])
    return [name for name in scores if name in chosen]


def checkpoint_module_names(paths: list[str], packed: dict[str, list[str]]) -> list[str]:
    """Fused slipstream module paths -> the checkpoint's module names (qkv_proj -> q_proj,
    k_proj, v_proj), as a checkpoint's `ignored_layers` lists them."""
    names = []
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        names.extend(f"{parent}.{sub}" for sub in packed.get(leaf, [leaf]))
    return names
