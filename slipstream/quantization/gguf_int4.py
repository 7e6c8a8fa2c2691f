"""int4_awq on a GGUF file: Q4_0 / Q4_1 blocks go straight into int4_awq's layout at group 32.

Q4_0 (w = (q - 8) d) maps exactly onto integer zeros of 8. Q4_1 (w = q d + m) maps exactly onto
float zeros, the layout's other zero form (kernels/gemv/int4_common.py): zeros = -m in float16,
the zero point times the scale, so w = q d - zeros with the file's own fp16 m; every int4 kernel
and the fused gate-out product take it. Other tensor types are dequantized, then rounded to
nearest at group 32 as int4_awq does with a float checkpoint.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slipstream.quantization import utils as qu
from slipstream.quantization.base import QuantMethod
from slipstream.quantization.int4_awq import GROUP_ATTR, Int4LinearMethod

BLOCK = 32  # values per GGUF block, the int4 group size
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (Q4_1: and fp16 m), then 16 bytes of nibbles
BLOCKS_PARAM = "gguf_blocks"  # the checkpoint's raw blocks, rows in HF order
# Fused parameter -> its checkpoint modules (the Llama family's packed_modules_mapping).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def gguf_int4_methods(hf_config: dict[str, Any]) -> Callable[[str], QuantMethod]:
    """The int4_awq factory for a GGUF file (hf_config["gguf"] from models/gguf.py): a layer
    whose checkpoint tensors are all Q4_0, or all Q4_1, loads its blocks; any other layer is
    quantized at load, group 32."""
    types = _module_types(hf_config["gguf"])

    def method_for(prefix: str) -> QuantMethod:
        parent, _, leaf = prefix.rpartition(".")
        kinds = {types.get(f"{parent}.{sub}") for sub in _FUSED.get(leaf, (leaf,))}
        kind = kinds.pop() if len(kinds) == 1 else None
        return GGUFInt4Method(kind) if kind in BLOCK_BYTES else Int4LinearMethod(BLOCK)

    return method_for


def _module_types(gguf: dict[str, Any]) -> dict[str, str]:
    """HF module name (model.layers.0.self_attn.q_proj) -> its weight's GGUF type name."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == gguf["architecture"])
    table = get_tensor_name_map(arch, gguf["block_count"])
    per_layer = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in
                                                            ("gate", "up", "down")]
    out = {}
    for i in range(gguf["block_count"]):
        for sub in per_layer:
            name = f"model.layers.{i}.{sub}"
            kind = gguf["tensor_types"].get(f"{table.get_name(name)}.weight")
            if kind is not None:
                out[name] = kind
    return out


class GGUFInt4Method(Int4LinearMethod):
    """int4_awq loaded from GGUF Q4_0 / Q4_1 blocks (`gguf_blocks` uint8 [N, K/32 * bytes])."""

    def __init__(self, kind: str):
        super().__init__(BLOCK, layout="gguf")
        self.kind = kind

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        if input_size % BLOCK:
            raise ValueError(f"GGUF {self.kind}: input size {input_size} is not a multiple of "
                             f"{BLOCK}")
        setattr(layer, GROUP_ATTR, BLOCK)
        n, width = sum(output_sizes), input_size // BLOCK * BLOCK_BYTES[self.kind]
        layer.register_parameter(BLOCKS_PARAM, qu.new_param(
            torch.empty(n, width, dtype=torch.uint8), output_dim=0,
            weight_loader=qu.packed_shard_loader(output_sizes, 0),
            dummy_value=_zero_blocks(n, width, self.kind)))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if BLOCKS_PARAM not in layer._parameters:
            return
        q, d, m = decode_blocks(layer._parameters.pop(BLOCKS_PARAM).data, self.kind)
        if m is None:
            zeros = torch.full(d.shape, 8, dtype=torch.uint8, device=d.device)
        else:  # float zeros hold z d = -m, not z = -m / d: exact to the file's fp16 m, and
            zeros = (-m).half()  # the kernels subtract it from q d without a multiply
        qu.replace_param(layer, "qweight", qu.pack_int4_rows(q), output_dim=0)
        qu.replace_param(layer, "scales", d.half(), output_dim=0)
        qu.replace_param(layer, "zeros", zeros, output_dim=0)


def decode_blocks(blocks: torch.Tensor, kind: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """uint8 [N, K/32 * bytes] -> (q uint8 [N, K] in 0..15, d float32 [N, K/32], m float32
    [N, K/32] or None for Q4_0). Byte j of a block's nibbles holds value j (low) and j + 16."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[kind])
    d = _fp16(b[..., 0:2])
    m = _fp16(b[..., 2:4]) if kind == "Q4_1" else None
    nibbles = b[..., -16:]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(n, -1)
    return q, d, m


def _fp16(pairs: torch.Tensor) -> torch.Tensor:
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()


def _zero_blocks(n: int, width: int, kind: str) -> torch.Tensor:
    """load_format="dummy": blocks of scale 2**-10 whose values are all 0 (random bytes could
    hold fp16 infinities)."""
    nbytes = BLOCK_BYTES[kind]
    block = torch.full((nbytes,), 0x88, dtype=torch.uint8)
    block[:2] = torch.tensor([2.0**-10], dtype=torch.float16).view(torch.uint8)
    if kind == "Q4_1":
        block[2:4] = torch.tensor([-8 * 2.0**-10], dtype=torch.float16).view(torch.uint8)
    return block.repeat(n, width // nbytes)
