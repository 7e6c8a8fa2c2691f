"""Per-request logit controls, applied after penalties and before temperature: logit_bias,
allowed_token_ids, bad_words, Python logits_processors (offline API), and the structured-output
grammar's token bitmask (last, so nothing can re-allow a token the grammar forbids).

`has_logit_controls` is the cheap per-row test the sampler runs first: a batch without any
control pays one attribute check per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slipstream.structured.bitmask import BitmaskFiller, apply_bitmask

if TYPE_CHECKING:
    from slipstream.engine.request import Request
    from slipstream.sampling_params import SamplingParams


def has_logit_controls(request: Request) -> bool:
    sp = request.sampling_params
    return request.grammar is not None or sp.has_logit_controls


def needs_known_tokens(params: SamplingParams) -> bool:
    """Whether the controls read the request's output tokens on the host before each sample
    (so its steps cannot be left unread: async_scheduling). A grammar reads only its matcher,
    which the engine advances before it samples (EngineCore._launch_async)."""
    return bool(params.bad_words_token_ids or params.logits_processors)


class LogitControls:
    """Applies every row's controls to logits [S, V] in place (row i is requests[i])."""

    def __init__(self) -> None:
        self._bitmask = BitmaskFiller()

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        grammar_drafts: dict[int, list[int]] | None = None,
    ) -> torch.Tensor:
        """grammar_drafts: per first row of a constrained verification, its draft tokens (row
        first + j is masked as after the first j drafts)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_logit_controls]
        if rows:
            _apply_bias(logits, requests, rows)
            _apply_allowed(logits, requests, rows)
            _apply_bad_words(logits, requests, rows)
            _apply_processors(logits, requests, rows)
        # A request the step before finished (its grammar ended) samples a token nobody reads.
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.is_finished]
        if grammar_rows:
            mask = self._bitmask.fill(requests, grammar_rows, logits.shape[1], logits.device, grammar_drafts)
            apply_bitmask(logits, mask, grammar_rows)
        return logits


def _apply_bias(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    idx_r: list[int] = []
    idx_t: list[int] = []
    values: list[float] = []
    for i in rows:
        for token, bias in (requests[i].sampling_params.logit_bias or {}).items():
            idx_r.append(i)
            idx_t.append(token)
            values.append(bias)
    if idx_r:
        index = torch.tensor([idx_r, idx_t], dtype=torch.long).to(logits.device, non_blocking=True)
        bias = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
        logits.index_put_((index[0], index[1]), bias, accumulate=True)


def _apply_allowed(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    for i in rows:
        allowed = requests[i].sampling_params.allowed_token_ids
        if allowed:
            keep = torch.tensor(allowed, dtype=torch.long).to(logits.device, non_blocking=True)
            row = torch.full_like(logits[i], float("-inf"))
            row[keep] = logits[i, keep]
            logits[i] = row


def _apply_bad_words(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """A bad word's last token is banned wherever the output so far ends with the rest of it."""
    idx_r: list[int] = []
    idx_t: list[int] = []
    for i in rows:
        request = requests[i]
        words = request.sampling_params.bad_words_token_ids
        if not words:
            continue
        output = request.output_token_ids
        for word in words:
            prefix = word[:-1]
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
                idx_r.append(i)
                idx_t.append(word[-1])
    if idx_r:
        index = torch.tensor([idx_r, idx_t], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")


def _apply_processors(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Each processor: fn(output_token_ids, logits_row [V]) -> logits_row (offline API)."""
    for i in rows:
        request = requests[i]
        for fn in request.sampling_params.logits_processors or ():
            row = logits[i]
            out = fn(list(request.output_token_ids), row)
            if out is not row:
                logits[i] = out
