"""Top-N logprobs: pick the top-k entries of log-softmax rows plus a given token's logprob.

Used by the sampler (generated tokens) and by the model runner (prompt logprobs). The device
work is batched; `gather_top_logprobs` returns tensors so a caller can fold them into its one
device-to-host copy, `top_logprobs` does the copy itself.
"""
from __future__ import annotations

import torch


def gather_top_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top_ids [N, k], top_vals [N, k], token_vals [N]) for logprobs [N, V], token_ids [N]."""
    k = max(0, min(int(k), logprobs.shape[-1]))
    token_vals = logprobs.gather(1, token_ids.view(-1, 1).to(torch.long)).squeeze(1)
    if k == 0:
        empty = logprobs.new_empty((logprobs.shape[0], 0))
        return empty.to(torch.long), empty, token_vals
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1)
    return top_ids, top_vals, token_vals


def to_dicts(
    top_ids: list[list[int]],
    top_vals: list[list[float]],
    token_ids: list[int],
    token_vals: list[float],
    ks: list[int] | None = None,
) -> list[dict[int, float]]:
    """Host lists -> one dict per row: top-k in rank order, then the token if not among them.

    `ks` lets rows keep fewer than the k the tensors were gathered with (a batch gathers the
    largest k any of its rows asked for).
    """
    out: list[dict[int, float]] = []
    for i, tok in enumerate(token_ids):
        k = len(top_ids[i]) if ks is None else ks[i]
        row = dict(zip(top_ids[i][:k], top_vals[i][:k]))
        row.setdefault(tok, token_vals[i])
        out.append(row)
    return out


def top_logprobs(
    logprobs: torch.Tensor, token_ids: list[int] | torch.Tensor, k: int
) -> list[dict[int, float]]:
    """For each row of logprobs [N, V]: {token: logprob} with the top-k plus token_ids[i]."""
    if logprobs.shape[0] == 0:
        return []
    ids = torch.as_tensor(token_ids, device=logprobs.device).view(-1)
    if ids.numel() != logprobs.shape[0]:
        raise ValueError(f"top_logprobs: {ids.numel()} token ids for {logprobs.shape[0]} rows")
    top_ids, top_vals, token_vals = gather_top_logprobs(logprobs, ids, k)
    return to_dicts(top_ids.tolist(), top_vals.tolist(), ids.tolist(), token_vals.tolist())
