"""Llama-family decoders as pooling models: headless checkpoints (LlamaModel, Qwen3Model, ...:
embedders such as Qwen3-Embedding) and *ForSequenceClassification (a `score` head on the pooled
last token). Same network as models/llama.py; the pooling runner pools its hidden states.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.attention.backend import AttentionMetadata
from slipstream.models.bert import num_labels
from slipstream.models.llama import BuildContext, LlamaForCausalLM, LlamaModel

_PACKED = LlamaForCausalLM.packed_modules_mapping


class LlamaHeadlessModel(LlamaModel):
    """A checkpoint saved as the bare decoder: tensor names carry no `model.` prefix."""

    packed_modules_mapping = _PACKED

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx, prefix="")

    @staticmethod
    def ignored_checkpoint_tensor(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")


class LlamaForSequenceClassification(nn.Module):
    """forward -> hidden [T, H]; pooling_head(last-token hidden) -> logits [S, num_labels]."""

    packed_modules_mapping = _PACKED

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.model = LlamaModel(ctx, "model")
        self.score = nn.Linear(ctx.cfg.hidden_size, num_labels(ctx.cfg.hf_config), bias=False,
                               dtype=ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled.to(self.score.weight.dtype))

    @staticmethod
    def ignored_checkpoint_tensor(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")
