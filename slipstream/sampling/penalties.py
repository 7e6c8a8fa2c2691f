"""Logits processors that look at a request's tokens: repetition / presence / frequency
penalties and the min_tokens mask. All work in place on a [S, V] float tensor, batched over
the rows that need them (one host-to-device copy of the token ids per step).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

if TYPE_CHECKING:
    from slipstream.engine.request import Request
    from slipstream.sampling_params import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts of each token id in each list."""
    rows = [torch.tensor(t, dtype=torch.long) for t in token_lists]
    # Pad with an extra id (vocab_size) whose counts land in a column that is dropped.
    padded = pad_sequence(rows, batch_first=True, padding_value=vocab_size)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF / CTRL: for tokens already seen, divide positive logits by the penalty and multiply
    negative ones. seen: [R, V] bool; penalty: [R]. In place."""
    p = penalty.view(-1, 1).to(logits.dtype)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return logits.copy_(torch.where(seen, penalized, logits))


def apply_presence_frequency_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0). counts: [R, V]. In place."""
    logits -= frequency.view(-1, 1) * counts
    logits -= presence.view(-1, 1) * (counts > 0).to(logits.dtype)
    return logits


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Apply each request's penalties to its row of logits [S, V] (row i = requests[i])."""
    rows = [i for i, r in enumerate(requests) if has_penalties(r.sampling_params)]
    if not rows:
        return logits
    reqs = [requests[i] for i in rows]
    device, vocab = logits.device, logits.shape[1]
    sub = logits[rows] if len(rows) < len(requests) else logits
    params = torch.tensor(
        [
            [r.sampling_params.repetition_penalty for r in reqs],
            [r.sampling_params.presence_penalty for r in reqs],
            [r.sampling_params.frequency_penalty for r in reqs],
        ],
        dtype=torch.float32,
    ).to(device, non_blocking=True)
    if any(r.sampling_params.repetition_penalty != 1.0 for r in reqs):
        # The prompt counts for repetition only; an empty list keeps pad_sequence happy.
        seen = token_counts([r.all_token_ids for r in reqs], vocab, device) > 0
        apply_repetition_penalty(sub, seen, params[0])
    if any(r.sampling_params.presence_penalty or r.sampling_params.frequency_penalty for r in reqs):
        counts = token_counts([r.output_token_ids for r in reqs], vocab, device)
        apply_presence_frequency_penalties(sub, counts, params[1], params[2])
    if sub is not logits:
        logits[rows] = sub
    return logits


def mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """While a request has fewer than min_tokens outputs, its EOS and stop token ids are -inf."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            continue
        for t in (*r.eos_token_ids, *sp.stop_token_ids):
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits
