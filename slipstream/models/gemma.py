"""Gemma 2 and Gemma 3 (text): the Llama attention and fused projections, with Gemma's options.

What differs from Llama: embeddings scaled by sqrt(hidden_size); GeGLU (gelu-tanh gate); four
norms a layer (before and after attention, before and after the MLP), each x * (1 + w); the
score scale query_pre_attn_scalar ** -0.5; attention-logit and final-logit soft-capping
(Gemma 2); sliding-window layers alternating with global ones (models/layer_types.py); Gemma 3's
q/k norms and its two RoPE tables (a local base for the window layers, the global base and
scaling for the others).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.config import ModelConfig
from slipstream.kernels.reference import softcap
from slipstream.layers.activation import GeluTanhAndMul
from slipstream.layers.embedding import LMHead, VocabEmbedding
from slipstream.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.models.layer_types import layer_sliding_windows, within
from slipstream.models.llama import BuildContext, KVCache, LlamaAttention

GEMMA_NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + weight)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate) * up); the down projection reads the activation as a plain input
    (the quant methods' fused gated kernels compute SiLU)."""

    def __init__(self, ctx: BuildContext, prefix: str):
        super().__init__()
        cfg = ctx.cfg
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, **ctx.linear_kwargs(f"{prefix}.gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, False, **ctx.linear_kwargs(f"{prefix}.down_proj")
        )
        hf = cfg.hf_config
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        self.act_fn = GeluTanhAndMul(ctx.ops, act)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj(self.act_fn(gate_up)), residual


class GemmaDecoderLayer(nn.Module):
    """Norm sandwiches around attention and the MLP. The residual stream is carried apart as in
    Llama: each pre-norm adds it (fused), each post-norm normalises the block's output."""

    def __init__(self, ctx: BuildContext, prefix: str, sliding_window: int | None):
        super().__init__()
        cfg = ctx.cfg
        hf = cfg.hf_config

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.ops, GEMMA_NORM_OFFSET)

        self.sliding = sliding_window is not None  # a local layer: the local RoPE table
        self.self_attn = LlamaAttention(
            ctx,
            f"{prefix}.self_attn",
            within(sliding_window, ctx.max_positions),
            scale=float(hf.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5,
            logit_softcap=hf.get("attn_logit_softcapping"),
            qk_norm=hf.get("model_type") != "gemma2",
            norm_offset=GEMMA_NORM_OFFSET,
        )
        self.mlp = GemmaMLP(ctx, f"{prefix}.mlp")
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_normed(hidden, residual, self.input_layernorm)
        hidden = self.post_attention_layernorm(attn.attend(qkv, positions, cos_sin_cache, kv_cache, meta))
        hidden, residual = self.mlp.forward_normed(hidden, residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(hidden), residual


class GemmaModel(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str = "model"):
        super().__init__()
        cfg = ctx.cfg
        # sqrt(hidden_size) rounded to the model dtype first, as transformers does.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=ctx.dtype))
        # Vocab-parallel: the scale below multiplies the summed (all-reduced) rows, once.
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.tp_size, ctx.tp_rank
        )
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(ctx, f"{prefix}.layers.{i}", windows[i]) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.ops, GEMMA_NORM_OFFSET)
        global_theta, global_scaling = rope_settings(cfg, "full_attention")
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, ctx.max_positions, global_theta, global_scaling, cfg.max_position_embeddings
        )
        local_theta, local_scaling = rope_settings(cfg, "sliding_attention")
        self.rotary_emb_local = RotaryEmbedding(
            cfg.head_dim, ctx.max_positions, local_theta, local_scaling, cfg.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale
        residual = None
        global_cs = self.rotary_emb.cos_sin_cache
        local_cs = self.rotary_emb_local.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos_sin = local_cs if layer.sliding else global_cs
            hidden, residual = layer(hidden, residual, positions, cos_sin, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def rope_settings(cfg: ModelConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of a layer type. transformers >= 5 keeps Gemma 3's per-type parameters
    in rope_parameters; older configs say rope_theta / rope_scaling for the global layers and
    rope_local_base_freq for the local ones. Gemma 2 has one table for both."""
    hf = cfg.hf_config
    params = hf.get("rope_parameters") or {}
    if layer_type in params:
        p = dict(params[layer_type])
        theta = float(p.pop("rope_theta", cfg.rope_theta))
        return theta, p if p.get("rope_type", p.get("type", "default")) != "default" else None
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        return float(hf["rope_local_base_freq"]), None
    return cfg.rope_theta, cfg.rope_scaling


class Gemma2ForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # The layers are built whole, without pipeline stages.
    supports_pipeline_parallel = False

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.config = ctx.cfg
        self.model = GemmaModel(ctx, "model")
        # Gemma ties its head to the embedding; its configs often leave the flag out.
        self.tied = bool(ctx.cfg.hf_config.get("tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tied else None
        self.lm_head = LMHead(
            ctx.cfg.vocab_size,
            ctx.cfg.hidden_size,
            ctx.dtype,
            tied=tied,
            tp_size=ctx.tp_size,
            tp_rank=ctx.tp_rank,
        )
        self.final_logit_softcap = ctx.cfg.hf_config.get("final_logit_softcapping")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab], soft-capped where configured (on the
        gathered logits under tensor parallelism: the cap is elementwise either way)."""
        return softcap(self.lm_head(hidden, float32), self.final_logit_softcap)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return self.tied and name == "lm_head.weight"


Gemma3ForCausalLM = Gemma2ForCausalLM  # q/k norms and the two RoPE tables come from the config


class Gemma3ForConditionalGeneration(Gemma2ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint, served as text only: its tensors
    carry a `language_model.` prefix, and the vision tower and projector are skipped."""

    _VISION = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def checkpoint_name(self, name: str) -> str:
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        return name.removeprefix("language_model.")  # language_model.lm_head.weight

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(self._VISION) or super().ignored_checkpoint_tensor(name)
