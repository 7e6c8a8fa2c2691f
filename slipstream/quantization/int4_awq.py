"""int4_awq: INT4 weight-only, groupwise along K (group 128 by default; any group size, and
per channel) with zero points, bf16 activations.

Sources: a float checkpoint (round-to-nearest at load; `slipstream quantize` first runs AWQ's
activation-aware scale and clipping search, awq.py), or pre-quantized
AutoAWQ (GEMM), GPTQ and compressed-tensors W4A16 (pack-quantized, llm-compressor) checkpoints.
All become one layout: qweight uint8 [N, K/2] (two values per byte along K), scales float16
[N, ceil(K/G)], zeros uint8 [N, ceil(K/G)]; w = (q - zero) * scale. (GGUF Q4_1 blocks,
gguf_int4.py, keep float16 zeros instead, the zero point times the scale: w = q * scale -
zero.) Where G does not divide K the last group is short: it is quantized as if zero-padded
to G (utils.pad_to_groups), and the pad is never stored, so no step reads or multiplies it.
The layer keeps its group size (GROUP_ATTR): the shapes alone cannot tell it when the last
group is short.

GPTQ act-order (desc_act; compressed-tensors actorder "group") checkpoints assign input columns
to groups out of order (g_idx). Their columns are permuted at load so that each group is
contiguous, and the layer keeps the permutation as a buffer (ACT_ORDER_PERM): apply gathers x's
columns in the same order first. The per-format unpacking helpers: int4_layouts.py.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.quantize_as_loaded import layer_hook_active
from slipstream.quantization import awq as awq_mod
from slipstream.quantization import compressed_tensors, int4_cpu
from slipstream.quantization import utils as qu
from slipstream.quantization.base import QuantMethod, UnquantizedLinearMethod, register_quant_method
from slipstream.quantization.calibration import collect_prompts
from slipstream.quantization.gptq import GptqOptions
from slipstream.quantization.int4_layouts import (
    CT_ZERO,
    act_order_perm,
    check_act_order_split,
    fp16_scales,
    g_idx_loader,
    weight_shape_loader,
    zero_point_loader,
)

logger = logging.getLogger(__name__)

DEFAULT_GROUP = 128
# `slipstream quantize`: GPTQ rounding (gptq.py) by default; AWQ's search by default only
# without it (calibration_choice). Measured on SmolLM2-135M at group 64: GPTQ +10.7% perplexity,
# AWQ +14.7%, AWQ's scales then GPTQ worse than GPTQ alone, round-to-nearest +25.3%
# (docs/quantization.md).
DEFAULT_GPTQ = True
GROUP_ATTR = "int4_group_size"  # the layer's group size (K itself: per channel)
# A norm folds into an int4 weight unless that raises the weight's rounding error by more than
# this factor (fold_costs_accuracy): the fold saves the norm's launch in a one-row decode.
FOLD_TOLERANCE = 1.05
FOLD_CHECK_ROWS = 2048
ACT_ORDER_PERM = "act_order_perm"  # buffer: int64 [K], input column j of qweight is x[..., perm[j]]
_CT_PARAMS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
NEEDS_CALIBRATION = True
# AWQ runs the model on the prompts itself: the engine pass of collect_linear_stats is not needed.
collect_calibration = collect_prompts


class Int4LinearMethod(QuantMethod):
    """layout: None (float checkpoint, RTN after loading), "awq", "gptq" or "compressed"
    (compressed-tensors pack-quantized; group_size None: per channel, one group of K per row).

    act_order: the checkpoint says desc_act / actorder "group" (refuses K-split layers up front;
    "compressed" layers then have a weight_g_idx. Whether a layer is permuted is read from its
    g_idx, so static-group act-order keeps the fast path). symmetric: compressed layers without
    weight_zero_point (zero 8).
    """

    def __init__(self, group_size: int | None = DEFAULT_GROUP, layout: str | None = None,
                 gptq_zero_offset: int = 1, act_order: bool = False, symmetric: bool = True):
        self.group_size, self.layout = group_size, layout
        self.gptq_zero_offset = gptq_zero_offset  # GPTQ v1 stores zero - 1
        self.act_order, self.symmetric = act_order, symmetric

    @property
    def folds_norm(self) -> bool:
        """A float checkpoint is rounded to nearest at load: the norm's weight can be folded into
        the 16-bit weight first (models/norm_fold.py). AWQ (`slipstream quantize`, a layer hook
        that keeps every norm) and pre-quantized checkpoints keep their norms."""
        return self.layout is None

    @torch.no_grad()
    def fold_costs_accuracy(self, weight: torch.Tensor, gamma: torch.Tensor) -> bool:
        """Whether folding the norm's gamma into this weight before round-to-nearest would round
        it worse: a group along K holds columns that gamma scales differently, so a few large
        gammas widen the whole group's range. Measured as the output error for normalised
        inputs of unit variance: ||(W - Q(W)) diag(gamma)|| unfolded against
        ||W diag(gamma) - Q(W diag(gamma))|| folded (docs/quantization.md: what it costs on a
        real model's norms)."""
        gamma = gamma.float()[None, :]
        g = self.group_size or weight.shape[1]
        kept = folded = 0.0
        for rows in weight.split(FOLD_CHECK_ROWS):  # bounded temporaries on a large layer
            w = rows.float()
            kept += ((_rtn(w, g) - w) * gamma).pow(2).sum().item()
            w = w * gamma
            folded += (_rtn(w, g) - w).pow(2).sum().item()
        return folded > FOLD_TOLERANCE * kept

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        n, k = sum(output_sizes), input_size
        g = self.group_size or k  # None: per-channel scales, one group spans the whole row
        check_int4_shape(self.layout, k, g, output_sizes)
        if self.layout is not None:
            check_group_split(layer, k, g)
        setattr(layer, GROUP_ATTR, g)
        if self.act_order:
            check_act_order_split(layer)
        if self.layout == "compressed":
            self._create_compressed(layer, k, g, output_sizes)
            return
        if self.layout is None:
            layer.register_parameter("weight", qu.new_param(
                qu.load_time_weight(n, k, params_dtype), output_dim=0, input_dim=1))
            return
        load8 = qu.packed_shard_loader(output_sizes, 1, 8)
        load1 = qu.packed_shard_loader(output_sizes, 1, 1)
        qshape = (k, n // 8) if self.layout == "awq" else (k // 8, n)
        groups = qu.int4_groups(k, g)
        params = {
            "qweight": (torch.empty(qshape, dtype=torch.int32), load8 if self.layout == "awq"
                        else load1),
            "qzeros": (torch.empty(groups, n // 8, dtype=torch.int32), load8),
            "scales": (torch.empty(groups, n, dtype=torch.float16), load1),
        }
        dummies = {}
        if self.layout == "gptq":  # one row per fused shard: they must agree (act_order_perm)
            params["g_idx"] = (torch.empty(len(output_sizes), k, dtype=torch.int32), g_idx_loader)
            dummies["g_idx"] = self._dummy_g_idx(len(output_sizes), k, g)
        for name, (data, loader) in params.items():
            layer.register_parameter(name, qu.new_param(data, weight_loader=loader,
                                                        dummy_value=dummies.get(name)))

    def _create_compressed(self, layer: nn.Module, k: int, g: int,
                           output_sizes: list[int]) -> None:
        """weight_packed int32 [N, K/8] and weight_scale [N, ceil(K/G)] (rows per fused shard),
        each shard's weight_shape, weight_zero_point (asymmetric), weight_g_idx (actorder
        group)."""
        n, shards, groups = sum(output_sizes), len(output_sizes), qu.int4_groups(k, g)
        rows = qu.packed_shard_loader(output_sizes, 0)
        params = {
            "weight_packed": (torch.empty(n, k // 8, dtype=torch.int32), rows),
            # float32 holds bf16 and fp16 checkpoint scales exactly until the fp16 conversion
            "weight_scale": (torch.empty(n, groups, dtype=torch.float32), rows),
            "weight_shape": (torch.empty(shards, 2, dtype=torch.int64),
                             weight_shape_loader(output_sizes, k)),
        }
        dummies = {"weight_shape": torch.tensor([[size, k] for size in output_sizes])}
        if not self.symmetric:  # unpacked to the canonical zeros (0..15) as it loads
            params["weight_zero_point"] = (torch.empty(n, groups, dtype=torch.uint8),
                                           zero_point_loader(output_sizes))
            dummies["weight_zero_point"] = torch.full((n, groups), CT_ZERO)
        if self.act_order:
            params["weight_g_idx"] = (torch.empty(shards, k, dtype=torch.int32), g_idx_loader)
            dummies["weight_g_idx"] = self._dummy_g_idx(shards, k, g)
        for name, (data, loader) in params.items():
            layer.register_parameter(name, qu.new_param(data, weight_loader=loader,
                                                        dummy_value=dummies.get(name)))

    def _dummy_g_idx(self, shards: int, k: int, g: int) -> torch.Tensor:
        """load_format="dummy": contiguous groups, or for act-order checkpoints the group of each
        column reversed (a valid order that is not the identity, so the gather runs as it
        would)."""
        group = torch.arange(k) // g
        if self.act_order:
            group = group.flip(0)
        return group.to(torch.int32).expand(shards, k)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if "qweight" in layer._parameters and layer.qweight.dtype == torch.uint8:
            return  # already in the canonical layout
        perm = None
        if self.layout is None:
            if not hasattr(layer, GROUP_ATTR):  # a float layer handed to this method afterwards
                setattr(layer, GROUP_ATTR, self.group_size or layer.weight.shape[1])
            q, scales, zeros = qu.quantize_int4_groupwise(layer.weight.data, group_of(layer))
            scales = scales.half()
            del layer._parameters["weight"]
        else:
            q, scales, zeros, perm = self._unpack_checkpoint(layer)
        dev = scales.device
        int4_cpu.forget(layer)
        qu.replace_param(layer, "qweight", qu.pack_int4_rows(q).to(dev), output_dim=0)
        qu.replace_param(layer, "scales", scales.to(dev), output_dim=0)
        qu.replace_param(layer, "zeros", zeros.to(dev), output_dim=0)
        if perm is not None:  # a buffer: moves with the module, never loaded or trained
            layer.register_buffer(ACT_ORDER_PERM, perm.to(dev))

    def _unpack_checkpoint(self, layer: nn.Module):
        """(q [N, K], scales, zeros, perm): perm None, or the act-order column order of q."""
        if self.layout == "compressed":
            return self._unpack_compressed(layer)
        qweight, qzeros = layer.qweight.data.cpu(), layer.qzeros.data.cpu()
        scales = layer.scales.data.t().contiguous()
        perm = None
        if self.layout == "awq":
            q = qu.unpack_int32_cols(qweight, qu.AWQ_ORDER).t()
            zeros = qu.unpack_int32_cols(qzeros, qu.AWQ_ORDER).t()
        else:
            q = qu.unpack_int32_cols(qweight.t().contiguous())  # packed along K
            # v1 stores zero - 1 in 4 bits: a zero of 0 wraps to 15 and back (mod 16).
            zeros = (qu.unpack_int32_cols(qzeros).t() + self.gptq_zero_offset) & 0xF
            perm = act_order_perm(layer.g_idx.data.cpu(), group_of(layer), tuple(q.shape))
            if perm is not None:
                q = q[:, perm]
            del layer._parameters["g_idx"]
        for name in ("qweight", "qzeros", "scales"):
            del layer._parameters[name]
        return q.contiguous(), scales.half(), zeros.to(torch.uint8).contiguous(), perm

    def _unpack_compressed(self, layer: nn.Module):
        """compressed-tensors pack-quantized -> (q [N, K], scales, zeros, perm) as above."""
        q = qu.unpack_int32_cols(layer.weight_packed.data.cpu())  # lowest nibble first, along K
        scales = fp16_scales(layer.weight_scale.data)
        if self.symmetric:
            zeros = torch.full(scales.shape, CT_ZERO, dtype=torch.uint8)
        else:
            zeros = layer.weight_zero_point.data.cpu()
        perm = None
        if self.act_order:
            perm = act_order_perm(layer.weight_g_idx.data.cpu(), group_of(layer),
                                  tuple(q.shape))
            if perm is not None:
                q = q[:, perm]
        for name in _CT_PARAMS:
            layer._parameters.pop(name, None)
        return q.contiguous(), scales, zeros.contiguous(), perm

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        perm = layer._buffers.get(ACT_ORDER_PERM)  # a dict lookup: AWQ / plain GPTQ skip the gather
        if perm is not None:
            x = x.index_select(-1, perm)  # into qweight's column order
        if not x.is_cuda:
            out = int4_cpu.linear(layer, x, group_of(layer), bias)
            if out is not None:
                return out
        fn = int4_linear_kernel()
        if fn is None:  # no Triton: dequantize and multiply
            return F.linear(x, _dequantize_stored(layer, x.dtype), bias)
        return fn(x, layer.qweight, layer.scales, layer.zeros, group_of(layer), bias)

    def apply_gate_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       rms_eps: float = 0.0) -> torch.Tensor | None:
        """One decode row on CUDA: the W4 GEMV writes silu_and_mul of the [gate | up] product
        (kernels.gemv.int4.w4_linear_small_gate_out), one launch less per layer; else None.
        rms_eps: of x / rms(x), where the measured config is the one-row kernel."""
        if not (x.is_cuda and x.numel() == x.shape[-1]) or not _kernels_take(layer, x):
            return None
        from slipstream.kernels.gemv.int4 import w4_linear_small_gate_out  # Triton: CUDA only

        perm = layer._buffers.get(ACT_ORDER_PERM)
        if perm is not None:
            x = x.index_select(-1, perm)
        return w4_linear_small_gate_out(x, layer.qweight, layer.scales, layer.zeros,
                                        group_of(layer), bias, rms_eps)

    def apply_rms(self, layer: nn.Module, x: torch.Tensor, eps: float,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
        """apply(x / rms(x)) in one W4 GEMV launch for one decode row on CUDA, where the
        measured config is the one-row kernel (kernels.gemv.int4.w4_linear_small_rms); else
        None."""
        if (not x.is_cuda or x.numel() != x.shape[-1] or ACT_ORDER_PERM in layer._buffers
                or not _kernels_take(layer, x)):
            return None
        from slipstream.kernels.gemv.int4 import w4_linear_small_rms  # Triton: CUDA only

        return w4_linear_small_rms(x, layer.qweight, layer.scales, layer.zeros, group_of(layer),
                                   bias, eps)

    def checkpoint_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """AutoAWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]."""
        if layer.zeros.is_floating_point():
            raise ValueError("int4_awq: a layer with float zero points (loaded from GGUF Q4_1 "
                             "blocks) cannot be saved in the AutoAWQ layout, whose zero points "
                             "are 4-bit integers; quantize a float checkpoint instead")
        if ACT_ORDER_PERM in layer._buffers:
            raise ValueError("int4_awq: a layer loaded from a GPTQ act-order (desc_act) checkpoint "
                             "cannot be saved in the AutoAWQ layout, whose groups are contiguous "
                             "along K; quantize the float checkpoint instead")
        if layer.qweight.shape[0] % 8:
            raise ValueError(f"int4_awq: the AutoAWQ layout packs eight output channels an int32; "
                             f"a layer of {layer.qweight.shape[0]} cannot be saved in it")
        q = qu.unpack_int4_rows(layer.qweight.data.cpu())
        return {
            "qweight": (qu.pack_int32_cols(q.t().contiguous(), qu.AWQ_ORDER), 1, 8),
            "qzeros": (qu.pack_int32_cols(layer.zeros.data.cpu().t().contiguous(),
                                          qu.AWQ_ORDER), 1, 8),
            "scales": (layer.scales.data.t().contiguous().half(), 1, 1),
        }


def _rtn(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w rounded to nearest in groups and dequantized (float16 scales, as stored)."""
    q, scales, zeros = qu.quantize_int4_groupwise(w, group_size)
    return qu.dequantize_int4_groupwise(q, scales.half(), zeros, torch.float32, group_size)


def group_of(layer: nn.Module) -> int:
    """The layer's group size (create_weights records it); K itself for per-channel scales."""
    return getattr(layer, GROUP_ATTR)


def check_group_split(layer: nn.Module, k: int, g: int) -> None:
    """A row-parallel layer of a pre-quantized checkpoint gives each rank K / tp input columns
    with the checkpoint's groups: they must start at a group boundary. (A float checkpoint
    quantized at load groups each rank's slice from its own start instead.)"""
    if getattr(layer, "tp_split", None) == "input" and getattr(layer, "tp_size", 1) > 1 and k % g:
        raise ValueError(f"int4_awq: a row-parallel layer's input size per rank ({k}, "
                         f"tensor_parallel_size={layer.tp_size}) is not a multiple of the "
                         f"checkpoint's group size {g}; use a tensor_parallel_size that splits "
                         f"K into whole groups")


def _kernels_take(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the fused one-row kernels take the layer's K and group (multiples of 16)."""
    k, g = x.shape[-1], group_of(layer)
    return k % 16 == 0 and g % 16 == 0


def check_int4_shape(layout: str | None, k: int, g: int, output_sizes: list[int]) -> None:
    """The shapes a layout holds: any group size (a short last group where it does not divide
    K), an even K (two values a byte; the packed formats: whole int32 words), and any N except
    where a checkpoint packs eight output channels a word (AutoAWQ qweight, AWQ / GPTQ qzeros)."""
    if g <= 0:
        raise ValueError(f"int4_awq: the group size must be positive, got {g}")
    k_multiple = {None: 2, "awq": 1, "gptq": 8, "compressed": 8}.get(layout, 1)
    if k % k_multiple:
        raise ValueError(f"int4_awq: input size {k} must be a multiple of {k_multiple} "
                         f"({layout or 'two 4-bit values a byte'})")
    if layout in ("awq", "gptq") and any(s % 8 for s in output_sizes):
        raise ValueError(f"int4_awq: {layout} checkpoints pack eight output channels an int32: "
                         f"output sizes {output_sizes} must be multiples of 8")


_INT4_LINEAR: list = []


def int4_linear_kernel():
    """kernels.gemv.int4.int4_linear (W4A16 GEMV / GEMM on CUDA, the float32 reference twin
    elsewhere), or None when Triton cannot load."""
    if not _INT4_LINEAR:
        try:  # lazy: Triton is an optional dependency, and CPU engines never need it
            from slipstream.kernels.gemv.int4 import int4_linear
        except ImportError:
            int4_linear = None
        _INT4_LINEAR.append(int4_linear)
    return _INT4_LINEAR[0]


def dequantize_layer(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's [N, K] weight in `dtype`, input columns in the checkpoint's order (reference
    path: materialised per call)."""
    w = _dequantize_stored(layer, dtype)
    perm = layer._buffers.get(ACT_ORDER_PERM)
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def _dequantize_stored(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's [N, K] weight in `dtype`, columns in qweight's (act-order) order."""
    q = qu.unpack_int4_rows(layer.qweight)
    return qu.dequantize_int4_groupwise(q, layer.scales, layer.zeros, dtype, group_of(layer))


def calibration_choice(awq: bool | None = None, gptq: bool | None = None) -> tuple[bool, bool]:
    """(AWQ search, GPTQ rounding) for `slipstream quantize` options: GPTQ unless turned off;
    AWQ where asked, else only without GPTQ (AWQ's scales before GPTQ measured worse than
    GPTQ alone)."""
    gptq = DEFAULT_GPTQ if gptq is None else bool(gptq)
    return (not gptq if awq is None else bool(awq)), gptq


def checkpoint_config(group_size: int | None = DEFAULT_GROUP, awq: bool | None = None,
                      gptq: bool | None = None) -> dict:
    """group_size None or <= 0: per channel, written as GPTQ's -1. `calibration` records how the
    integers were chosen (the loader does not read it: every variant is the same layout)."""
    awq, gptq = calibration_choice(awq, gptq)
    group = group_size if group_size and group_size > 0 else -1
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "calibration": {"awq_scales": bool(awq), "gptq": bool(gptq)}}


def make_method(group_size: int | None = DEFAULT_GROUP, awq: bool | None = None,
                gptq: bool | None = None) -> Int4LinearMethod:
    """A method that quantizes a loaded float weight (used by `slipstream quantize`); group_size
    None or <= 0: per channel."""
    return Int4LinearMethod(group_size if group_size and group_size > 0 else None)


@register_quant_method("int4_awq")
def make_int4(hf_config: dict):
    if "gguf" in (hf_config or {}):  # a GGUF file: its Q4_0 / Q4_1 blocks at group 32
        from slipstream.quantization.gguf_int4 import gguf_int4_methods

        return gguf_int4_methods(hf_config)
    prequantized = qu.check_checkpoint_method("int4_awq", hf_config)
    qc = qu.quant_config_of(hf_config)
    if prequantized and compressed_tensors.is_compressed_tensors(qc):
        return _compressed_tensors_methods(hf_config, qc)
    group = _group_size(qc.get("group_size", DEFAULT_GROUP))
    layout = None
    if prequantized:
        layout = str(qc["quant_method"]).lower()
        layout = "awq" if layout == "int4_awq" else layout
        if int(qc.get("bits", 4)) != 4:
            raise ValueError(f"int4_awq loads 4-bit checkpoints, this one has bits={qc['bits']}")
        if layout == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc.get('version')!r}: only the GEMM layout loads")
    elif not layer_hook_active():  # `slipstream quantize` runs AWQ inside the load instead
        logger.info("int4_awq at load time: round-to-nearest; `slipstream quantize --method "
                    "int4_awq` runs the AWQ scale search on calibration data")
    offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    # Act-order with one group per row only reorders GPTQ's work: nothing to gather.
    act_order = layout == "gptq" and bool(qc.get("desc_act")) and group is not None
    return lambda prefix: Int4LinearMethod(group, layout, offset, act_order)


def _group_size(value) -> int | None:
    """A checkpoint's group_size; -1 (GPTQ's "no groups") or 0: None, one group per row."""
    group = int(value)
    return group if group > 0 else None


def _compressed_tensors_methods(hf_config: dict, qc: dict):
    """llm-compressor W4A16 (scheme checked by compressed_tensors.int4_problem): layers outside
    the targets or in `ignore` stay float."""
    quantized, weights = compressed_tensors.int4_layer_filter(hf_config, qc)
    group = int(weights.group_size) if weights.strategy == "group" else None
    # Only actorder "group" stores g_idx; "weight" reorders GPTQ's work but keeps groups contiguous.
    act_order = weights.actorder == "group"

    def method_for(prefix: str) -> QuantMethod:
        if not quantized(prefix):
            return UnquantizedLinearMethod()
        return Int4LinearMethod(group, "compressed", act_order=act_order,
                                symmetric=weights.symmetric)

    return method_for


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
                             awq: bool | None = None, gptq: bool | None = None) -> None:
    """AWQ scales (and clipping, without GPTQ) on the calibration prompts, then
    round-to-nearest or GPTQ rounding (gptq.py, which stores the projections already
    quantized) (Llama family); calibration_choice resolves awq / gptq.

    stats: collect_calibration's (or collect_linear_stats') result; AWQ and GPTQ run its prompts
    layer by layer.
    """
    awq, gptq = calibration_choice(awq, gptq)
    if not (awq or gptq):
        return
    prompts = getattr(stats, "prompts", None)
    if not prompts:
        raise ValueError("int4_awq: the AWQ search and GPTQ need the calibration prompts "
                         "(calibration.collect_prompts)")
    awq_mod.awq_prepare(model, prompts, group_size, awq=awq,
                        gptq=GptqOptions() if gptq else None)
