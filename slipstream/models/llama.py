"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): one class, config flags for the variants.

Qwen2: bias on q/k/v. Qwen3: RMSNorm on each head of q and k before RoPE. Mistral (and Qwen
where configured): sliding-window attention (models/layer_types.py). Parameter names follow
the HF checkpoint, except q/k/v and gate/up which are fused (see `packed_modules_mapping`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.config import ModelConfig
from slipstream.kernels.attention.l2_spans import span_table
from slipstream.layers.activation import SiluAndMul
from slipstream.layers.attention import Attention
from slipstream.layers.embedding import LMHead, VocabEmbedding
from slipstream.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding, rotary_dim_of
from slipstream.models.layer_types import layer_sliding_windows, within
from slipstream.parallel.pipeline import PipelineStage, stage_of
from slipstream.parallel.sharding import kv_heads_per_rank
from slipstream.quantization.base import QuantMethodFactory, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class BuildContext:
    """What every layer needs at construction: dtype, kernel table, backend, quant methods."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: SimpleNamespace, backend,
                 quant_factory: QuantMethodFactory | None = None, max_positions: int | None = None,
                 tp_size: int = 1, tp_rank: int = 0, local_experts: Sequence[int] | None = None,
                 stage: PipelineStage | None = None):
        self.cfg, self.dtype, self.ops, self.backend = cfg, dtype, ops, backend
        # Builds each decoder layer's MLP: (ctx, prefix) -> module; None: LlamaMLP. An MoE
        # family (models/moe.py) puts its sparse block here.
        self.mlp_factory: Callable[[BuildContext, str], nn.Module] | None = None
        self.local_experts = local_experts  # MoE: the experts this rank holds (None: all)
        self.quant_factory = quant_factory or (lambda prefix: UnquantizedLinearMethod())
        self.max_positions = max(max_positions or 0, cfg.max_position_embeddings)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.stage = stage  # pipeline parallel: this rank's layers (None: all of them)

    def linear_kwargs(self, prefix: str) -> dict:
        return dict(params_dtype=self.dtype, quant_method=self.quant_factory(prefix),
                    tp_size=self.tp_size, tp_rank=self.tp_rank)


class LlamaAttention(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str, sliding_window: int | None = None, *,
                 scale: float | None = None, logit_softcap: float | None = None,
                 qk_norm: bool | None = None, norm_offset: float = 0.0):
        """Options for other families: the score scale (default head_dim ** -0.5),
        attention-logit soft-capping, q/k norms (default: the config's qk_norm) and their
        weight offset (Gemma's 1 + w)."""
        super().__init__()
        cfg = ctx.cfg
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = hq * d // ctx.tp_size
        hkv_local = kv_heads_per_rank(hkv, ctx.tp_size)
        self.kv_size = hkv_local * d
        # Qwen2 has bias on q/k/v only; Llama/Qwen3 attention_bias also covers o_proj.
        o_bias = cfg.attention_bias and cfg.hf_config.get("model_type") not in ("qwen2", "qwen2_moe")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, hq, hkv, cfg.attention_bias,
                                          **ctx.linear_kwargs(f"{prefix}.qkv_proj"))
        self.o_proj = RowParallelLinear(hq * d, cfg.hidden_size, o_bias,
                                        **ctx.linear_kwargs(f"{prefix}.o_proj"))
        if cfg.qk_norm if qk_norm is None else qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ctx.dtype, ctx.ops, norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ctx.dtype, ctx.ops, norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(hq // ctx.tp_size, hkv_local, d, d**-0.5 if scale is None else scale,
                              ctx.backend, sliding_window=sliding_window,
                              logit_softcap=logit_softcap)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(hidden), positions, cos_sin_cache, kv_cache, meta)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               kv_cache: KVCache, meta: AttentionMetadata,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer after its q/k/v projection: attention, then o_proj (+ residual, added in
        o_proj's kernel where it can)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            t, d = q.shape[0], self.attn.head_dim
            q = self.q_norm.forward_heads(q.reshape(t, -1, d)).reshape(t, -1)
            k = self.k_norm.forward_heads(k.reshape(t, -1, d)).reshape(t, -1)
        out = self.attn(q, k, v, positions, cos_sin_cache, kv_cache, meta)
        return self.o_proj(out) if residual is None else self.o_proj.forward_residual(out, residual)


class LlamaMLP(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str, intermediate_size: int | None = None):
        super().__init__()
        cfg = ctx.cfg
        bias = bool(cfg.hf_config.get("mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter] * 2, bias,
            **ctx.linear_kwargs(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias,
                                           **ctx.linear_kwargs(f"{prefix}.down_proj"))
        self.act_fn = SiluAndMul(ctx.ops, cfg.hf_config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(self.gate_up_proj(x), self.act_fn)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), new residual), the norm fused where the method can."""
        if x.is_cuda and x.numel() == x.shape[-1]:
            # One decode row: the gate/up GEMV writes SiLU(gate)·up itself where it can, and
            # the down projection reads it as a plain input instead of recomputing the
            # activation in each of its output tiles (which doubles the down GEMV's loop).
            h, new_residual = (norm(x), x) if residual is None else norm(x, residual)
            act = self.gate_up_proj.forward_gate_out(h)
            if act is not None:
                return self.down_proj(act), new_residual
            return self.down_proj.forward_gated(self.gate_up_proj(h), self.act_fn), new_residual
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj.forward_gated(gate_up, self.act_fn), residual

    def forward_folded_row(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """stream + forward(norm(stream)) for one row, norm folded into gate_up (norm_fold.py):
        the gate/up GEMV normalises and writes SiLU(gate)·up, the down GEMV adds the stream."""
        act = self.gate_up_proj.forward_gate_out(stream, norm.eps)
        if act is None:  # the method's kernel cannot normalise: the norm kernel first
            h = norm(stream)
            act = self.gate_up_proj.forward_gate_out(h)
            if act is None:
                return self.down_proj.forward_gated(self.gate_up_proj(h), self.act_fn) + stream
        return self.down_proj.forward_residual(act, stream)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str, sliding_window: int | None = None):
        super().__init__()
        cfg = ctx.cfg
        self.self_attn = LlamaAttention(ctx, f"{prefix}.self_attn", sliding_window)
        self.mlp = (ctx.mlp_factory or LlamaMLP)(ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype,
                                                ctx.ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[0] == 1 and self.input_layernorm.folded and \
                self.post_attention_layernorm.folded:
            return self._forward_folded_row(hidden, residual, positions, cos_sin_cache,
                                            kv_cache, meta)
        # The residual stream is carried separately so each norm can fuse the add (and, for
        # methods that quantize activations, the quantization of the next layer's input).
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_normed(hidden, residual, self.input_layernorm)
        hidden = attn.attend(qkv, positions, cos_sin_cache, kv_cache, meta)
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)

    def _forward_folded_row(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                            kv_cache: KVCache, meta: AttentionMetadata
                            ) -> tuple[torch.Tensor, None]:
        """One row (a batch-1 decode step) with both norms folded into the projections they
        feed (models/norm_fold.py): the QKV and gate/up GEMVs normalise their input themselves
        and the o and down GEMVs add the residual as they write, so a layer launches no norm
        kernel. Returns (the residual stream, None), the convention for "no add pending"."""
        stream = hidden if residual is None else hidden + residual
        attn, norm = self.self_attn, self.input_layernorm
        qkv = attn.qkv_proj.forward_rms(stream, norm.eps)
        if qkv is None:  # the method's kernel cannot normalise: the norm kernel first
            qkv = attn.qkv_proj(norm(stream))
        stream = attn.attend(qkv, positions, cos_sin_cache, kv_cache, meta, residual=stream)
        return self.mlp.forward_folded_row(stream, self.post_attention_layernorm), None


class LlamaModel(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str = "model"):
        super().__init__()
        cfg = ctx.cfg
        self.stage = stage = stage_of(ctx.stage, cfg.num_hidden_layers)
        # Pipeline parallel: a stage builds only its own layers (the others stay empty slots,
        # so names and indices match the checkpoint's), the first the embedding, the last the
        # final norm (and LMHead, in LlamaForCausalLM).
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                                            ctx.tp_size, ctx.tp_rank)
                             if stage.has_embedding else None)
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(ctx, f"{prefix}.layers.{i}", within(windows[i], ctx.max_positions))
            if stage.owns_layer(i) else nn.Module()
            for i in range(cfg.num_hidden_layers))
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.ops)
                     if stage.has_head else None)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(cfg.head_dim, cfg.hf_config),
                                          ctx.max_positions, cfg.rope_theta,
                                          cfg.rope_scaling, cfg.max_position_embeddings)
        self.hidden_size, self.dtype = cfg.hidden_size, ctx.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        if not self.stage.is_whole_model:
            return self.stage.forward(self, input_ids, positions, kv_caches, meta)
        hidden = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.rotary_emb.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, cos_sin, kv_cache, meta)
        if residual is None:  # no layers, or the last one added its residual (folded norms)
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]."""

    # Fused parameter -> the checkpoint tensors it holds, in shard order.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.config = ctx.cfg
        self.model = LlamaModel(ctx, "model")
        tied = self.model.embed_tokens if ctx.cfg.tie_word_embeddings else None
        self.lm_head = None
        if self.model.stage.has_head:  # pipeline parallel: the last stage only
            self.lm_head = LMHead(ctx.cfg.vocab_size, ctx.cfg.hidden_size, ctx.dtype, tied=tied,
                                  tp_size=ctx.tp_size, tp_rank=ctx.tp_rank)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def norm_fold_pairs(self) -> dict[str, str]:
        """{projection: the RMSNorm feeding it} of every decoder layer (models/norm_fold.py)."""
        pairs = {}
        for i in range(self.model.stage.start, self.model.stage.end):
            layer = f"model.layers.{i}"
            pairs[f"{layer}.self_attn.qkv_proj"] = f"{layer}.input_layernorm"
            pairs[f"{layer}.mlp.gate_up_proj"] = f"{layer}.post_attention_layernorm"
        return pairs

    def attach_l2_prefetch(self, budget: int, targets: tuple[str, ...] = ("o", "gate_up")
                           ) -> int:
        """Give each layer's attention the span table of the weights read right after it: all
        of o_proj, then gate/up's leading rows, up to `budget` bytes (kernels/attention/l2_spans.py; 0
        detaches); `targets` picks among the two. Returns the bytes a layer prefetches."""
        per_layer = 0
        for i in range(self.model.stage.start, self.model.stage.end):
            layer = self.model.layers[i]
            groups = [_own_tensors(_prefetch_target(layer, name)) for name in targets]
            table = span_table(groups, budget, groups[0][0].device) if budget else None
            layer.self_attn.attn.l2_prefetch = table
            per_layer = 0 if table is None else int(table[:, 1].sum())
        return per_layer

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab], float32 (else the model's dtype);
        None on a pipeline stage without the head."""
        if self.lm_head is None:
            return None
        return self.lm_head(hidden, float32)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors we skip: cached rotary tables, the tied head's duplicate."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if not self.model.stage.is_whole_model and not self.model.stage.holds_tensor(name):
            return True  # pipeline parallel: another stage's tensor
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            # A last pipeline stage without the embedding fills its own head (tied_head_alias).
            return self.model.embed_tokens is not None
        return False


def _prefetch_target(layer: nn.Module, name: str) -> nn.Module:
    """A decoder layer's o_proj ("o") or its MLP's gate/up projection ("gate_up"), looked up
    only when asked: a sparse MoE block has no gate_up_proj."""
    return layer.self_attn.o_proj if name == "o" else layer.mlp.gate_up_proj


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A layer's parameters and buffers (weights, scales, zeros, bias), not its children's."""
    return [t.data for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]


# Same network, different checkpoints' names for it.
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
