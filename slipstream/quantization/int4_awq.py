"""int4_awq: INT4 weight-only, groupwise along K (group 128) with zero points, bf16 activations.

Sources: a float checkpoint (round-to-nearest at load; `slipstream quantize` first runs AWQ's
activation-aware scale and clipping search, awq.py), or pre-quantized
AutoAWQ (GEMM) and GPTQ checkpoints. All become one layout: qweight uint8 [N, K/2] (two values
per byte along K), scales float16 [N, K/G], zeros uint8 [N, K/G]; w = (q - zero) * scale.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization import awq as awq_mod
from slipstream.quantization import utils as qu
from slipstream.quantization.base import QuantMethod, register_quant_method
from slipstream.quantization.calibration import collect_prompts

logger = logging.getLogger(__name__)

DEFAULT_GROUP = 128
NEEDS_CALIBRATION = True
# AWQ runs the model on the prompts itself: the engine pass of collect_linear_stats is not needed.
collect_calibration = collect_prompts


class Int4LinearMethod(QuantMethod):
    """layout: None (float checkpoint, RTN after loading), "awq" or "gptq" (pre-quantized)."""

    def __init__(self, group_size: int = DEFAULT_GROUP, layout: str | None = None,
                 gptq_zero_offset: int = 1):
        self.group_size, self.layout = group_size, layout
        self.gptq_zero_offset = gptq_zero_offset  # GPTQ v1 stores zero - 1

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        n, k, g = sum(output_sizes), input_size, self.group_size
        if k % g or any(s % 8 for s in output_sizes):
            raise ValueError(f"int4_awq: input size {k} must be a multiple of the group size {g} "
                             f"and output sizes {output_sizes} multiples of 8")
        if self.layout is None:
            layer.register_parameter("weight", qu.new_param(
                torch.empty(n, k, dtype=params_dtype), output_dim=0, input_dim=1))
            return
        load8 = qu.packed_shard_loader(output_sizes, 1, 8)
        load1 = qu.packed_shard_loader(output_sizes, 1, 1)
        qshape = (k, n // 8) if self.layout == "awq" else (k // 8, n)
        params = {
            "qweight": (torch.empty(qshape, dtype=torch.int32), load8 if self.layout == "awq"
                        else load1),
            "qzeros": (torch.empty(k // g, n // 8, dtype=torch.int32), load8),
            "scales": (torch.empty(k // g, n, dtype=torch.float16), load1),
        }
        if self.layout == "gptq":
            params["g_idx"] = (torch.empty(k, dtype=torch.int32), _copy_loader)
        for name, (data, loader) in params.items():
            layer.register_parameter(name, qu.new_param(data, weight_loader=loader))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if "qweight" in layer._parameters and layer.qweight.dtype == torch.uint8:
            return  # already in the canonical layout
        if self.layout is None:
            q, scales, zeros = qu.quantize_int4_groupwise(layer.weight.data, self.group_size)
            scales = scales.half()
            del layer._parameters["weight"]
        else:
            q, scales, zeros = self._unpack_checkpoint(layer)
        dev = scales.device
        qu.replace_param(layer, "qweight", qu.pack_int4_rows(q).to(dev), output_dim=0)
        qu.replace_param(layer, "scales", scales.to(dev), output_dim=0)
        qu.replace_param(layer, "zeros", zeros.to(dev), output_dim=0)

    def _unpack_checkpoint(self, layer: nn.Module):
        qweight, qzeros = layer.qweight.data.cpu(), layer.qzeros.data.cpu()
        scales = layer.scales.data.t().contiguous()
        if self.layout == "awq":
            q = qu.unpack_int32_cols(qweight, qu.AWQ_ORDER).t()
            zeros = qu.unpack_int32_cols(qzeros, qu.AWQ_ORDER).t()
        else:
            q = qu.unpack_int32_cols(qweight.t().contiguous())  # packed along K
            # v1 stores zero - 1 in 4 bits: a zero of 0 wraps to 15 and back (mod 16).
            zeros = (qu.unpack_int32_cols(qzeros).t() + self.gptq_zero_offset) & 0xF
            g_idx = layer.g_idx.data.cpu().long()
            if not torch.equal(g_idx, torch.arange(q.shape[1]) // self.group_size):
                raise NotImplementedError("GPTQ act-order (desc_act, permuted g_idx) checkpoints "
                                          "are not supported yet")
            del layer._parameters["g_idx"]
        for name in ("qweight", "qzeros", "scales"):
            del layer._parameters[name]
        return q.contiguous(), scales.half(), zeros.to(torch.uint8).contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        fn = _int4_linear()
        if fn is None:  # no Triton: dequantize and multiply
            return F.linear(x, dequantize_layer(layer, x.dtype), bias)
        group = x.shape[-1] // layer.scales.shape[1]  # also right for one group per row
        return fn(x, layer.qweight, layer.scales, layer.zeros, group, bias)

    def checkpoint_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """AutoAWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]."""
        q = qu.unpack_int4_rows(layer.qweight.data.cpu())
        return {
            "qweight": (qu.pack_int32_cols(q.t().contiguous(), qu.AWQ_ORDER), 1, 8),
            "qzeros": (qu.pack_int32_cols(layer.zeros.data.cpu().t().contiguous(),
                                          qu.AWQ_ORDER), 1, 8),
            "scales": (layer.scales.data.t().contiguous().half(), 1, 1),
        }


_INT4_LINEAR: list = []


def _int4_linear():
    """kernels.gemv_int4.int4_linear (W4A16 GEMV / GEMM on CUDA, the float32 reference twin
    elsewhere), or None when Triton cannot load."""
    if not _INT4_LINEAR:
        try:
            from slipstream.kernels.gemv_int4 import int4_linear
        except ImportError:
            int4_linear = None
        _INT4_LINEAR.append(int4_linear)
    return _INT4_LINEAR[0]


def dequantize_layer(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's [N, K] weight in `dtype` (reference path: materialised per call)."""
    q = qu.unpack_int4_rows(layer.qweight)
    return qu.dequantize_int4_groupwise(q, layer.scales, layer.zeros, dtype)


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    param.data.copy_(loaded)  # g_idx: the same for every fused shard


def checkpoint_config(group_size: int = DEFAULT_GROUP, awq: bool = True) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}


def make_method(group_size: int = DEFAULT_GROUP, awq: bool = True) -> Int4LinearMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`)."""
    return Int4LinearMethod(group_size)


@register_quant_method("int4_awq")
def make_int4(hf_config: dict):
    prequantized = qu.check_checkpoint_method("int4_awq", hf_config)
    qc = qu.quant_config_of(hf_config)
    group = int(qc.get("group_size", DEFAULT_GROUP))
    layout = None
    if prequantized:
        layout = str(qc["quant_method"]).lower()
        layout = "awq" if layout == "int4_awq" else layout
        if int(qc.get("bits", 4)) != 4:
            raise ValueError(f"int4_awq loads 4-bit checkpoints, this one has bits={qc['bits']}")
        if layout == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc.get('version')!r}: only the GEMM layout loads")
        if layout == "gptq" and qc.get("desc_act"):
            raise NotImplementedError("GPTQ desc_act (act-order) checkpoints are not supported")
    else:
        logger.info("int4_awq at load time: round-to-nearest; `slipstream quantize --method "
                    "int4_awq` runs the AWQ scale search on calibration data")
    offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    return lambda prefix: Int4LinearMethod(group, layout, offset)


# --- AWQ: activation-aware scale and clipping search (slipstream/quantization/awq.py) ------------

def awq_search(w: torch.Tensor, x: torch.Tensor, absmean: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """Per-input-channel scale s (w * s is quantized, x / s fed in) minimising ||x w^T - x w_q^T||
    for one linear layer on its input rows x; s = 1 (plain RTN) is a candidate, so the result is
    never worse than RTN on x. (`slipstream quantize` scores whole blocks: awq.awq_prepare.)"""
    w, x = w.float(), x.float()
    want = x @ w.t()

    def loss(wq: torch.Tensor) -> float:
        return (x @ wq.t() - want).pow(2).mean().item()

    return awq_mod.search_scale(w, absmean.float(), loss, group_size)[0]


@torch.no_grad()
def prepare_for_quantization(model: nn.Module, stats: dict, group_size: int = DEFAULT_GROUP,
                             awq: bool = True) -> None:
    """AWQ scales and clipping on the calibration prompts, before round-to-nearest (Llama family).

    stats: collect_calibration's (or collect_linear_stats') result; AWQ runs its prompts layer by
    layer.
    """
    if not awq:
        return
    prompts = getattr(stats, "prompts", None)
    if not prompts:
        raise ValueError("int4_awq: the AWQ search needs the calibration prompts "
                         "(calibration.collect_prompts)")
    awq_mod.awq_prepare(model, prompts, group_size)
