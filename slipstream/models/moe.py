"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a gated shared expert), Qwen3-MoE.

The attention, norms and residual stream are the Llama family's (models/llama.py); each
decoder layer's MLP is a `SparseMoeBlock` instead: a router (a [E, H] linear), top-k routing
with the checkpoint's rule, the routed experts (layers/moe.FusedMoE), and for Qwen2-MoE a
shared expert scaled by sigmoid(shared_expert_gate(x)). Qwen's `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense.

Routing: softmax over the experts, the top k, renormalised to sum to 1 by the checkpoint's
rule (models/moe_config.renormalizes).

Checkpoints store each expert apart (`experts.<e>.w1/w3/w2` for Mixtral, `experts.<e>.gate_proj
/up_proj/down_proj` for Qwen); they load into slices of the stacked weights.
"""
from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.moe import FusedMoE
from slipstream.layers.moe_fp8_checkpoint import Fp8ExpertCheckpoint
from slipstream.layers.moe_int4_checkpoint import Int4ExpertCheckpoint
from slipstream.layers.norm import RMSNorm
from slipstream.models.llama import BuildContext, LlamaForCausalLM, LlamaMLP
from slipstream.models.moe_config import (
    expert_intermediate_size,
    is_sparse_layer,
    num_experts_of,
    renormalizes,
)
from slipstream.models.quantize_as_loaded import decoder_layer_of
from slipstream.quantization.base import UnquantizedLinearMethod

_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.")


class Router(nn.Module):
    """router_logits = x @ weight^T: [T, E], in the model's dtype (kept unquantized: the
    expert choice is sensitive to its rounding, and the weight is small)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype, out: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out or num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """forward(x) = routed experts (+ sigmoid(shared_expert_gate(x)) * shared_expert(x))."""

    def __init__(self, ctx: BuildContext, prefix: str):
        super().__init__()
        cfg = ctx.cfg.hf_config
        num_experts = num_experts_of(cfg)
        self.gate = Router(num_experts, ctx.cfg.hidden_size, ctx.dtype)
        weight_format, fp8_checkpoint = expert_weight_format(ctx, f"{prefix}.experts")
        group = expert_int4_group(ctx, f"{prefix}.experts", cfg) if weight_format == "int4" else 0
        int4_checkpoint = expert_int4_checkpoint(ctx, f"{prefix}.experts", group)
        self.experts = FusedMoE(
            num_experts, cfg["num_experts_per_tok"], ctx.cfg.hidden_size,
            expert_intermediate_size(cfg), ctx.dtype, renormalize=renormalizes(cfg),
            weight_format=weight_format, fp8_checkpoint=fp8_checkpoint, int4_group_size=group,
            int4_checkpoint=int4_checkpoint, local_experts=ctx.local_experts,
            use_triton=ctx.ops.name == "triton", tp_size=ctx.tp_size, tp_rank=ctx.tp_rank)
        shared = cfg.get("shared_expert_intermediate_size") or 0
        if shared:
            self.shared_expert = LlamaMLP(ctx, f"{prefix}.shared_expert", shared)
            self.shared_expert_gate = Router(1, ctx.cfg.hidden_size, ctx.dtype, out=1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return out

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), new residual): the decoder layer's MLP contract."""
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return self.forward(h), residual


def expert_weight_format(ctx: BuildContext, prefix: str
                         ) -> tuple[str | None, Fp8ExpertCheckpoint | None]:
    """(weight format, pre-quantized FP8 layout) of the experts from the model's quantization
    method: fp8, int8 or int4 when it quantizes at load, a pre-quantized FP8 checkpoint's
    layout, None unquantized; anything else is refused rather than run in 16 bits unnoticed."""
    from slipstream.quantization.fp8 import Fp8LinearMethod
    from slipstream.quantization.int4_awq import Int4LinearMethod
    from slipstream.quantization.int8_wo import Int8WeightOnlyMethod

    method = ctx.quant_factory(prefix)
    if type(method) is UnquantizedLinearMethod:
        return None, None
    prequantized = getattr(method, "prequantized", True)
    if type(method) is Fp8LinearMethod:
        if not prequantized:
            return "fp8", None
        return "fp8", Fp8ExpertCheckpoint(method.block_size, method.block_scale_name
                                          if method.block_size is not None else "weight_scale")
    if type(method) is Int8WeightOnlyMethod and not prequantized:
        return "int8", None
    if type(method) is Int4LinearMethod and method.layout in (None, "awq", "gptq"):
        return "int4", None
    raise ValueError(f"MoE experts support quantization 'fp8' (at load or pre-quantized), "
                     f"'int8_wo' (at load) and 'int4_awq' (at load, or GPTQ / AWQ GEMM "
                     f"checkpoints), not {type(method).__name__} (prequantized: "
                     f"{prequantized})")


def expert_int4_group(ctx: BuildContext, prefix: str, cfg: dict) -> int:
    """The int4 group size along K for the experts: the method's (None, per channel: one group
    the width of the larger input, hidden or intermediate)."""
    group = ctx.quant_factory(prefix).group_size
    return group or max(ctx.cfg.hidden_size, expert_intermediate_size(cfg))


def expert_int4_checkpoint(ctx: BuildContext, prefix: str, group: int
                           ) -> Int4ExpertCheckpoint | None:
    """The GPTQ / AWQ layout of pre-quantized int4 experts; None for int4 at load (or not
    int4: group 0)."""
    if not group:
        return None
    method = ctx.quant_factory(prefix)
    if method.layout is None:
        return None
    return Int4ExpertCheckpoint(method.layout, group, method.gptq_zero_offset)


def _mlp_factory(ctx: BuildContext, prefix: str) -> nn.Module:
    layer = decoder_layer_of(prefix)
    index = layer[1] if layer is not None else 0
    if is_sparse_layer(ctx.cfg.hf_config, index):
        return SparseMoeBlock(ctx, prefix)
    return LlamaMLP(ctx, prefix)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama-family attention with sparse MoE MLPs; checkpoint names per family below."""

    # The block's name in checkpoints, and its experts' (gate, up, down) tensor names.
    checkpoint_block = "mlp"
    expert_tensor_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, ctx: BuildContext):
        ctx = copy.copy(ctx)
        ctx.mlp_factory = _mlp_factory
        super().__init__(ctx)

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        # getattr: a pipeline stage holds placeholders, without an mlp, for other stages' layers
        return {i: layer.mlp for i, layer in enumerate(self.model.layers)
                if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)}

    def remap_checkpoint_names(self, name_map: dict[str, tuple[str, int | None]]
                               ) -> dict[str, tuple[str, int | None]]:
        """The loader's checkpoint name -> (parameter, shard) map, with the stacked expert
        weights replaced by each expert's tensors and the block renamed as in checkpoints."""
        out = {}
        for name, target in name_map.items():
            if ".experts.w13_" in name or ".experts.w2_" in name:
                continue
            out[self._checkpoint_name(name)] = target
        for i, block in self.moe_blocks().items():
            prefix = f"model.layers.{i}.{self.checkpoint_block}.experts"
            for name, (param, shard) in block.experts.checkpoint_names(
                    prefix, self.expert_tensor_names).items():
                out[name] = (param.replace(f".{self.checkpoint_block}.", ".mlp.", 1), shard)
        return out

    def _checkpoint_name(self, name: str) -> str:
        if self.checkpoint_block == "mlp":
            return name
        layer = decoder_layer_of(name)
        if layer is None or not isinstance(getattr(self.model.layers[layer[1]], "mlp", None),
                                           SparseMoeBlock):
            return name
        return name.replace(f"{layer[0]}.mlp.", f"{layer[0]}.{self.checkpoint_block}.", 1)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """Also the experts that other ranks hold (expert parallelism)."""
        if super().ignored_checkpoint_tensor(name):
            return True
        match = _EXPERT_TENSOR.search(name)
        layer = decoder_layer_of(name)
        if match is None or layer is None:
            return False
        block = self.moe_blocks().get(layer[1])
        return block is not None and int(match.group(1)) not in block.experts.local_experts

    def norm_fold_pairs(self) -> dict[str, str]:
        """Only norms feeding a plain projection fold; the experts keep their input norm."""
        pairs = super().norm_fold_pairs()
        for i in self.moe_blocks():
            pairs.pop(f"model.layers.{i}.mlp.gate_up_proj", None)
        return pairs

    def attach_l2_prefetch(self, budget: int, targets: tuple[str, ...] = ("o", "gate_up")
                           ) -> int:
        """o_proj only: which experts follow the attention is known only after routing."""
        return super().attach_l2_prefetch(budget, ("o",))


class MixtralForCausalLM(MoeForCausalLM):
    checkpoint_block = "block_sparse_moe"
    expert_tensor_names = ("w1", "w3", "w2")


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass

