"""GPT-2: LayerNorm with bias, learned position embeddings, GELU MLP, biases everywhere.

Its checkpoint stores each projection as a Conv1D, weight [in, out]: transposed as it loads.
c_attn holds q, k and v fused already. GPT-2 has no RoPE: the attention backend gets an
identity table (cos 1, sin 0), which leaves q and k bit for bit, so the paged-attention paths
(fused decode included) serve it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.layers.attention import Attention
from slipstream.layers.embedding import LMHead, VocabEmbedding
from slipstream.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from slipstream.models.llama import BuildContext, KVCache

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class _Conv1DWeights:
    """A linear layer filled from Conv1D checkpoint tensors ([in, out]): cut for this rank in
    that layout (c_attn's q, k and v apart), then transposed (linear.LinearBase.weight_loader)."""

    checkpoint_transposed = True


class Conv1DQKV(_Conv1DWeights, QKVParallelLinear):
    pass


class Conv1DColumn(_Conv1DWeights, ColumnParallelLinear):
    pass


class Conv1DRow(_Conv1DWeights, RowParallelLinear):
    pass


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, params_dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=params_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class GPT2Attention(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str):
        super().__init__()
        cfg = ctx.cfg
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.c_attn = Conv1DQKV(cfg.hidden_size, d, h, h, True, **ctx.linear_kwargs(f"{prefix}.c_attn"))
        self.c_proj = Conv1DRow(h * d, cfg.hidden_size, True, **ctx.linear_kwargs(f"{prefix}.c_proj"))
        self.attn = Attention(h // ctx.tp_size, h // ctx.tp_size, d, d**-0.5, ctx.backend)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        identity_rope: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, positions, identity_rope, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str):
        super().__init__()
        cfg = ctx.cfg
        self.c_fc = Conv1DColumn(
            cfg.hidden_size, cfg.intermediate_size, True, **ctx.linear_kwargs(f"{prefix}.c_fc")
        )
        self.c_proj = Conv1DRow(
            cfg.intermediate_size, cfg.hidden_size, True, **ctx.linear_kwargs(f"{prefix}.c_proj")
        )
        act = cfg.hf_config.get("activation_function", "gelu_new")
        if act not in _GELU:
            raise ValueError(f"unsupported activation_function {act!r}; supported: {', '.join(_GELU)}")
        self.approximate = _GELU[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x).float(), approximate=self.approximate).to(x.dtype)
        return self.c_proj(h)


class GPT2Block(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str):
        super().__init__()
        cfg = ctx.cfg
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.attn = GPT2Attention(ctx, f"{prefix}.attn")
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp = GPT2MLP(ctx, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        identity_rope: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), positions, identity_rope, kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str = "transformer"):
        super().__init__()
        cfg = ctx.cfg
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.tp_size, ctx.tp_rank)
        # Learned positions: every rank holds the whole (small) table.
        self.wpe = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size, ctx.dtype)
        self.h = nn.ModuleList(GPT2Block(ctx, f"{prefix}.h.{i}") for i in range(cfg.num_hidden_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        rows = cfg.max_position_embeddings  # no position past the learned ones (checked above)
        identity = torch.cat(
            [torch.ones(rows, cfg.head_dim // 2), torch.zeros(rows, cfg.head_dim // 2)], dim=-1
        )
        self.register_buffer("identity_rope", identity.to(torch.get_default_device()), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            x = block(x, positions, self.identity_rope, kv_cache, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]. The
    head is the token embedding unless the config unties them (GPT-2's default is tied)."""

    packed_modules_mapping: dict[str, list[str]] = {}
    # The blocks are built whole, without pipeline stages.
    supports_pipeline_parallel = False

    def __init__(self, ctx: BuildContext):
        super().__init__()
        hf = ctx.cfg.hf_config
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(flag):
                raise ValueError(f"GPT-2 with {flag}=true is not supported")
        if hf.get("scale_attn_weights") is False:
            raise ValueError("GPT-2 with scale_attn_weights=false is not supported")
        if ctx.max_positions > ctx.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {ctx.max_positions} exceeds GPT-2's "
                f"{ctx.cfg.max_position_embeddings} learned positions"
            )
        self.config = ctx.cfg
        self.tied = bool(hf.get("tie_word_embeddings", True))
        self.transformer = GPT2Model(ctx, "transformer")
        self.lm_head = LMHead(
            ctx.cfg.vocab_size,
            ctx.cfg.hidden_size,
            ctx.dtype,
            tied=self.transformer.wte if self.tied else None,
            tp_size=ctx.tp_size,
            tp_rank=ctx.tp_rank,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, float32)

    def checkpoint_name(self, name: str) -> str:
        """OpenAI's GPT-2 checkpoints name tensors without the `transformer.` prefix."""
        return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """The tied head's copy and the attention-mask buffers older checkpoints saved."""
        return (self.tied and name == "lm_head.weight") or name.endswith((".attn.bias", ".attn.masked_bias"))
