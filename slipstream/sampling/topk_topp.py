"""Truncation of the sampling distribution: top-k, top-p (nucleus) and min-p, batched.

Each takes per-row parameters as device tensors; a row whose parameter is neutral (k == 0,
p == 1, min_p == 0) is left exactly as it was. Removed tokens get -inf.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _kth_largest(values_desc: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[S, 1] threshold: the k-th largest value per row (-inf where k == 0 means off)."""
    k = top_k.clamp(min=1, max=values_desc.shape[1]).to(torch.long)
    kth = values_desc.gather(1, (k - 1).view(-1, 1))
    return torch.where((top_k > 0).view(-1, 1), kth, torch.full_like(kth, _NEG_INF))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept, as in HF).

    top_k: [S] integer tensor, 0 = off. max_k: its largest value when the caller knows it on
    the host (saves a device sync). Returns a new tensor.
    """
    if max_k is None:
        max_k = int(top_k.max().item()) if top_k.numel() else 0
    max_k = min(max_k, logits.shape[1])
    if max_k <= 0:
        return logits
    top_vals = torch.topk(logits, max_k, dim=-1).values
    return logits.masked_fill(logits < _kth_largest(top_vals, top_k), _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """Top-k then top-p over one descending sort. top_p keeps the smallest set of most likely
    tokens whose probability (after top-k) reaches p. Returns a new tensor."""
    if top_p is None:
        return logits if top_k is None else apply_top_k(logits, top_k, max_k)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = _kth_largest(sorted_logits, top_k)
        logits = logits.masked_fill(logits < kth, _NEG_INF)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token goes once the more likely ones already reach p; the first one always stays.
    remove_sorted = (mass_before >= top_p.view(-1, 1)) & (top_p < 1.0).view(-1, 1)
    remove_sorted[:, 0] = False
    remove = torch.empty_like(remove_sorted).scatter_(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.view(-1, 1).to(probs.dtype) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)
