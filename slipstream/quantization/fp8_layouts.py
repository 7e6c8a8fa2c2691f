"""How pre-quantized FP8 checkpoints store their layers, read into the fp8 method's layout:
HF `quant_method: fp8` (per tensor / channel / block; layers left float by
`modules_to_not_convert` / `ignored_layers`) and Meta's `fbgemm_fp8`. Block-wise scales are
requantized per output channel at load (the fp8 kernels take one scale per row)."""
from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from slipstream.quantization import compressed_tensors, modelopt
from slipstream.quantization.utils import (
    new_param,
    packed_shard_loader,
    quantize_fp8_per_channel,
    replace_param,
)

logger = logging.getLogger(__name__)


def _every_layer(prefix: str) -> bool:
    return True


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint's fp8 layers are stored (the defaults: a float checkpoint to quantize)."""

    quantized: Callable[[str], bool] = _every_layer  # layer prefix -> stored in fp8?
    static_input_scale: bool = False
    block_size: tuple[int, int] | None = None  # one scale per [rows, cols] block
    unused_tensors: tuple[str, ...] = ()  # per-layer checkpoint tensors nothing reads
    # The block scales' checkpoint name: HF / DeepSeek weight_scale_inv, compressed-tensors
    # weight_scale (both: multiply the stored values by it).
    block_scale_name: str = "weight_scale_inv"


FBGEMM_METHOD = "fbgemm_fp8"


def hf_fp8_layout(hf_config: dict, qc: dict) -> Fp8Layout:
    """The layout of an HF `fp8` (AutoFP8, Qwen3 / DeepSeek FP8), `fbgemm_fp8` or ModelOpt FP8
    checkpoint."""
    packed = compressed_tensors.packed_modules_of(hf_config)
    if modelopt.is_modelopt(qc):
        # Per-tensor weight scales (broadcast over each fused shard's rows: exact) or per-channel
        # ones; a per-tensor checkpoint's static input_scale is read and unused: activations
        # are scaled per token at run time.
        return Fp8Layout(not_converted_filter(modelopt.excluded_modules(qc), packed),
                         static_input_scale=modelopt.static_input_scale(qc))
    quantized = not_converted_filter(not_converted_modules(qc), packed)
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
    """prefix of a slipstream linear layer -> whether the checkpoint quantized it."""
    return compressed_tensors.fused_layer_filter(
        packed, lambda name: is_listed(name, not_converted),
        lambda name: not is_listed(name, not_converted),
        "the checkpoint's list of unquantized modules")


def is_listed(name: str, entries: tuple[str, ...]) -> bool:
    """Whether an entry names module `name` or a module around it, in whole dotted parts: the
    full name, a prefix ("model.layers.1", which is not one of "model.layers.10..."), a tail
    ("down_proj") or a run in between ("self_attn"); `*` matches any characters (fnmatch)."""
    dotted = f".{name}."
    return any(fnmatch.fnmatchcase(name, e) or fnmatch.fnmatchcase(name, f"{e}.*") if "*" in e
               else f".{e.strip('.')}." in dotted for e in entries)


def create_block_scales(layer: nn.Module, input_size: int, output_sizes: list[int],
                        block_size: tuple[int, int], name: str = "weight_scale_inv") -> None:
    """Block scales `name`, float32 [sum of each shard's ceil(n / rows), ceil(K / cols)]: a fused
    layer's shards each bring their own block rows (the last one may be partial)."""
    block_rows = [_ceil_div(n, block_size[0]) for n in output_sizes]
    shape = (sum(block_rows), _ceil_div(input_size, block_size[1]))
    layer.register_parameter(name, new_param(
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
                                  chunk_rows: int = 1024, name: str = "weight_scale_inv") -> None:
    """Block-scaled fp8 weight (block scales in parameter `name`) -> the per-channel layout:
    dequantize each block, requantize each output row (in place, chunk by chunk: peak extra
    memory is a few chunks in float32)."""
    weight, scale_inv = layer.weight.data, getattr(layer, name).data
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
    del layer._parameters[name]
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
