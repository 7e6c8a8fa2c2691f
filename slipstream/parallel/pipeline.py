"""Pipeline parallelism inside a model: which decoder layers a stage owns, and the forward of
one stage (receive the previous stage's activations, run its layers, send them on).

Between stages travel the hidden state and the residual stream, [T, hidden] each; every rank
knows T from the step's batch, so no shapes are exchanged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from slipstream.parallel import state as parallel_state
from slipstream.parallel.sharding import stage_layers

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    """Decoder layers [start, end) of pp_size stages' stage pp_rank."""

    pp_size: int
    pp_rank: int
    start: int
    end: int

    @staticmethod
    def of(num_layers: int, pp_size: int, pp_rank: int) -> PipelineStage:
        return PipelineStage(pp_size, pp_rank, *stage_layers(num_layers, pp_size, pp_rank))

    @property
    def is_whole_model(self) -> bool:
        return self.pp_size == 1

    @property
    def has_embedding(self) -> bool:
        return self.pp_rank == 0

    @property
    def has_head(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def holds_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs on this stage."""
        match = _LAYER.search(name)
        if match is not None:
            return self.owns_layer(int(match.group(1)))
        if "embed_tokens" in name:
            return self.has_embedding
        return self.has_head  # the final norm and the head

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list, meta) -> torch.Tensor:
        """This stage's part of LlamaModel.forward-shaped models (embed_tokens, layers, norm,
        rotary_emb). kv_caches: this stage's layers only. Returns the final normed hidden
        state on the last stage; elsewhere what it sent (the caller ignores it)."""
        if self.has_embedding:
            hidden, residual = model.embed_tokens(input_ids), None
        else:
            shape = (input_ids.shape[0], model.hidden_size)
            hidden, residual = parallel_state.pp_recv([shape, shape], model.dtype,
                                                      input_ids.device)
        cos_sin = model.rotary_emb.cos_sin_cache
        for i in range(self.start, self.end):
            hidden, residual = model.layers[i](hidden, residual, positions, cos_sin,
                                               kv_caches[i - self.start], meta)
        if not self.has_head:
            # A layer that added its own residual returns None: the next stage adds zeros.
            parallel_state.pp_send([hidden, torch.zeros_like(hidden) if residual is None
                                    else residual])
            return hidden
        if residual is None:
            return model.norm(hidden)
        return model.norm(hidden, residual)[0]


def stage_of(stage: PipelineStage | None, num_layers: int) -> PipelineStage:
    """The stage a model builds (None: the whole model)."""
    return stage if stage is not None else PipelineStage(1, 0, 0, num_layers)


def tied_head_alias(model) -> dict[str, str]:
    """{checkpoint name: parameter name} for a last stage without the embedding whose head is
    tied to it: that stage loads the embedding's tensor into its own head."""
    stage = getattr(getattr(model, "model", None), "stage", None)
    if stage is None or stage.has_embedding or not stage.has_head:
        return {}
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    return {"model.embed_tokens.weight": "lm_head.weight"}
