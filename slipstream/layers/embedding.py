"""Token embedding and LM head; the head may share the embedding's weight (tied)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization.base import _triton_ops


class VocabEmbedding(nn.Module):
    """[vocab, hidden] table, allocated uninitialised (the loader fills it)."""

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=params_dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> float32 logits. With `tied`, reuses the embedding's weight (no copy)."""

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype,
                 tied: VocabEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=params_dtype),
                                       requires_grad=False)

    def forward(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """float32=False: logits in the weight's dtype, for a caller that converts them itself
        (the decode graphs copy them into a float32 buffer: one pass over the logits, not two)."""
        if hidden.is_cuda:  # decode batches: a Triton GEMV where it measured faster than cuBLAS
            logits = _triton_ops().linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        return logits.float() if float32 else logits
