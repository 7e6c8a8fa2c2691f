"""Pool a step's flat hidden states per sequence (last token, mean or CLS), then apply a
classification head or the per-request embedding options (Matryoshka truncation, L2 norm).

Plain PyTorch on the hidden states' device; float32 math.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.pooling.config import PoolerConfig


def pool(hidden: torch.Tensor, query_start_loc: list[int], pooling_type: str) -> torch.Tensor:
    """hidden [T, H] of whole sequences laid end to end -> [S, H] float32."""
    starts = torch.tensor(query_start_loc, device=hidden.device)
    if pooling_type == "last":
        return hidden[starts[1:] - 1].float()
    if pooling_type == "cls":
        return hidden[starts[:-1]].float()
    if pooling_type == "mean":
        lengths = starts[1:] - starts[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                               lengths)
        sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
        sums.index_add_(0, seq_of_token, hidden.float())
        return sums / lengths.unsqueeze(1)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish_embedding(vector: torch.Tensor, params: dict | None, config: PoolerConfig
                     ) -> torch.Tensor:
    """One pooled vector [H] -> the embedding the request asked for."""
    params = params or {}
    dims = params.get("dimensions")
    if dims is not None:
        vector = vector[:dims]
    normalize = params.get("normalize")
    if config.normalize if normalize is None else normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector


def check_pooling_params(params: dict | None, config: PoolerConfig, hidden_size: int,
                         is_classifier: bool) -> None:
    """ValueError for options this model cannot honour (before the request is queued)."""
    dims = (params or {}).get("dimensions")
    if dims is None:
        return
    if is_classifier:
        raise ValueError("dimensions applies to embeddings, not to a classification model")
    if not config.matryoshka:
        raise ValueError("this model does not support matryoshka representation: "
                         "dimensions cannot be set")
    if dims > hidden_size:
        raise ValueError(f"dimensions must be at most the model's {hidden_size}, got {dims}")
