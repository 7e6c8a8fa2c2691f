"""Top-N logprobs: the top-k entries of log-softmax rows plus a given token's logprob.

Used by the sampler (generated tokens) and by the model runner (prompt logprobs). The device
work is batched and the result is packed into one float64 tensor, so reading it back costs a
single device-to-host copy (float64 holds token ids and float32 values exactly).
"""
from __future__ import annotations

import torch


def pack_top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[N, 2 + 2k] float64 rows: (token id, token logprob, k top ids, k top logprobs).

    logprobs: [N, V] log-softmax rows; token_ids: [N] on the same device.
    """
    k = max(0, min(int(k), logprobs.shape[-1]))
    ids = token_ids.view(-1, 1).to(device=logprobs.device, dtype=torch.long)
    token_vals = logprobs.gather(1, ids)
    parts = [ids.double(), token_vals.double()]
    if k > 0:
        top_vals, top_ids = torch.topk(logprobs, k, dim=-1)
        parts += [top_ids.double(), top_vals.double()]
    return torch.cat(parts, dim=1)


def unpack_top_logprobs(rows: list[list[float]], ks: list[int] | None = None) -> list[dict[int, float]]:
    """Host rows of `pack_top_logprobs` -> one dict per row: top-k in rank order, then the
    given token if it is not among them. `ks` lets a row keep fewer than the k it was packed
    with (a batch packs the largest k any of its rows asked for)."""
    out: list[dict[int, float]] = []
    for i, row in enumerate(rows):
        k_packed = (len(row) - 2) // 2
        k = k_packed if ks is None else min(ks[i], k_packed)
        top_ids = row[2 : 2 + k]
        top_vals = row[2 + k_packed : 2 + k_packed + k]
        d = {int(t): v for t, v in zip(top_ids, top_vals)}
        d.setdefault(int(row[0]), row[1])
        out.append(d)
    return out


def top_logprobs(
    logprobs: torch.Tensor, token_ids: list[int] | torch.Tensor, k: int
) -> list[dict[int, float]]:
    """For each row of logprobs [N, V]: {token: logprob} with the top-k plus token_ids[i]."""
    ids = torch.as_tensor(token_ids, device=logprobs.device).view(-1)
    if ids.numel() != logprobs.shape[0]:
        raise ValueError(f"top_logprobs: {ids.numel()} token ids for {logprobs.shape[0]} rows")
    if logprobs.shape[0] == 0:
        return []
    return unpack_top_logprobs(pack_top_logprobs(logprobs, ids, k).tolist())
