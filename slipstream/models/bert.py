"""BERT encoders (BertModel, BertForSequenceClassification): the classic sentence-embedding and
cross-encoder checkpoints, for the pooling runner.

Bidirectional attention over each whole sequence of the flat batch, so no KV cache: a prompt
is encoded in one step and nothing outlives it. Parameter names follow the HF checkpoint.
Token type ids are 0, or 1 from a request's second segment on (sentence pairs for a
cross-encoder: `token_type_ids`, built by the pooling runner).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.models.llama import BuildContext

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {name!r} is not supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12), dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.query = nn.Linear(hidden, hidden, dtype=dtype)
        self.key = nn.Linear(hidden, hidden, dtype=dtype)
        self.value = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        t, hidden = x.shape
        heads = self.num_heads
        q, k, v = (proj(x).view(t, heads, hidden // heads).transpose(0, 1)
                   for proj in (self.query, self.key, self.value))
        out = torch.empty_like(q)
        for lo, hi in zip(starts[:-1], starts[1:]):  # each sequence attends to itself only
            out[:, lo:hi] = F.scaled_dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        return out.transpose(0, 1).reshape(t, hidden)


class BertDenseNorm(nn.Module):
    """dense, then LayerNorm(dense(x) + residual): BERT's post-norm sub-layer output."""

    def __init__(self, in_size: int, cfg: dict, dtype: torch.dtype):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.dense = nn.Linear(in_size, hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12), dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        self.self = BertSelfAttention(cfg, dtype)
        self.output = BertDenseNorm(cfg["hidden_size"], cfg, dtype)

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        return self.output(self.self(x, starts), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], dtype=dtype)
        self.act = _activation(cfg.get("hidden_act", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertDenseNorm(cfg["intermediate_size"], cfg, dtype)

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        x = self.attention(x, starts)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, starts)
        return x


class BertPooler(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"], dtype=dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertModel(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches (unused), meta, token_type_ids [T] or
    None) -> hidden [T, H]."""

    uses_kv_cache = False
    takes_token_types = True

    def __init__(self, ctx: BuildContext):
        super().__init__()
        cfg = ctx.cfg.hf_config
        self.embeddings = BertEmbeddings(cfg, ctx.dtype)
        self.encoder = BertEncoder(cfg, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, token_type_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        return self.encoder(x, meta.query_start_loc_cpu)

    @staticmethod
    def ignored_checkpoint_tensor(name: str) -> bool:
        # Sentence embeddings read the encoder's output: the pooler (CLS dense + tanh, a
        # classification head) is not used.
        return name.startswith("pooler.") or name.endswith("position_ids")


class BertForSequenceClassification(nn.Module):
    """BERT + pooler + classifier: pooling_head(CLS hidden) -> logits [S, num_labels]."""

    uses_kv_cache = False
    takes_token_types = True

    def __init__(self, ctx: BuildContext):
        super().__init__()
        cfg = ctx.cfg.hf_config
        self.bert = nn.Module()
        self.bert.embeddings = BertEmbeddings(cfg, ctx.dtype)
        self.bert.encoder = BertEncoder(cfg, ctx.dtype)
        self.bert.pooler = BertPooler(cfg, ctx.dtype)
        self.classifier = nn.Linear(cfg["hidden_size"], num_labels(cfg), dtype=ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, token_type_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.bert.embeddings(input_ids, positions, token_type_ids)
        return self.bert.encoder(x, meta.query_start_loc_cpu)

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(pooled))

    @staticmethod
    def ignored_checkpoint_tensor(name: str) -> bool:
        return name.endswith("position_ids")


def num_labels(hf_config: dict) -> int:
    """A classification checkpoint's label count (id2label, else num_labels, else 2)."""
    labels = hf_config.get("id2label")
    return len(labels) if labels else int(hf_config.get("num_labels", 2))
