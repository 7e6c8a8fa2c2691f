"""Verification of draft tokens (speculative decoding), inside the ordinary sampler.

A seq that feeds its last token and k draft tokens gets k + 1 rows of logits. Row i is sampled
exactly as a plain decode step would sample that position (greedy argmax; or temperature,
top-k/p, min-p and an exponential race drawn from the request's own generator when seeded).
Drafts are accepted while each equals the token sampled at its position; the first mismatch is
replaced by that sampled token, and when all k match, row k gives one more (the bonus token).

Drafts are deterministic (n-gram lookup, a greedy draft model), so the draft distribution q is
one-hot on the draft token d. Standard speculative rejection sampling then accepts d with
probability min(1, p(d) / q(d)) = p(d), and on rejection samples from max(p - q, 0)
normalised, which is p with d removed. Sampling x ~ p and accepting iff x == d has exactly those
two laws, so the output follows the target distribution. Greedy requests get exactly the tokens
of decoding without speculation. A seeded request's generator is rewound to just after the rows
it kept, so it draws once per emitted token as without speculation: the same seed gives the
same tokens with or without speculation, whatever else is in the batch.

A constrained request's rows are masked by its grammar as plain steps would be: row j with the
grammar after the first j drafts. The masked sample is the token constrained decoding gives
there, so drafts (the tokens the grammar forces, speculative/grammar_drafts.py) change how many
steps it takes, never its tokens.

A draft tree (speculative/tree.py) is verified the same way along its branches: from the root,
the child whose draft equals the token sampled at the current row is accepted. Each row is
sampled independently from the target's distribution at its position, so the emitted tokens
follow it too. Seeded requests get chains only (the decoder's choice), so their draws stay one
per emitted token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slipstream.sampling.sampler import Sampler, request_generator
from slipstream.speculative.tree import accept_path

if TYPE_CHECKING:
    from slipstream.scheduler.output import RunnerOutput, ScheduledSeq


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """Leading draft tokens equal to the token sampled at their position."""
    n = 0
    for d, t in zip(drafts, sampled):
        if d != t:
            break
        n += 1
    return n


def verify_into(out: RunnerOutput, sampler: Sampler, logits: torch.Tensor, seqs: list[ScheduledSeq]
                ) -> dict[str, list[int]]:
    """Sample every row of a step with draft tokens and put, per sampled seq, its accepted
    drafts plus one sampled token (and their logprobs when asked) into `out`. Returns, per
    seq that verified a draft tree, the draft indices of its accepted path (its chunk rows
    past the root are path[i] + 1): the runner moves their K/V into place.

    logits: [rows, V], rows in seq order: num_spec_tokens + 1 rows a sampled seq."""
    sampled_seqs = [s for s in seqs if s.needs_sample]
    row_requests = [s.request for s in sampled_seqs for _ in range(s.num_spec_tokens + 1)]
    saved = _seeded_states(sampled_seqs, logits.device)
    result = sampler(logits, row_requests, _grammar_drafts(sampled_seqs))
    row, paths = 0, {}
    for seq in sampled_seqs:
        n = seq.num_spec_tokens + 1
        tokens = result.token_ids[row : row + n]
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_spec_tokens :]
        rid = seq.request_id
        if seq.spec_parents:
            # A tree: its accepted path's rows, in order (a row's token is its child's draft).
            paths[rid] = accept_path(drafts, seq.spec_parents, tokens)
            rows = [0] + [i + 1 for i in paths[rid]]
        else:
            rows = list(range(num_accepted(drafts, tokens) + 1))
        keep = len(rows)
        out.sampled_token_ids[rid] = [tokens[r] for r in rows]
        if seq.num_spec_tokens:
            out.spec_row_token_ids[rid] = list(tokens)
        lps = [result.logprobs[row + r] for r in rows]
        if lps and lps[0] is not None:
            out.logprobs[rid] = lps
        if rid in saved and keep < n:
            _rewind(seq.request, saved[rid], keep, logits)
        row += n
    return paths


def _grammar_drafts(seqs: list[ScheduledSeq]) -> dict[int, list[int]] | None:
    """Per first row of a constrained seq with drafts, its drafts: row j of it is masked with
    the grammar after j drafts, as a plain step there would be (structured/grammar.py)."""
    found, row = {}, 0
    for seq in seqs:
        if seq.num_spec_tokens and seq.request.grammar is not None:
            found[row] = seq.token_ids[len(seq.token_ids) - seq.num_spec_tokens :]
        row += seq.num_spec_tokens + 1
    return found or None


def _seeded_states(seqs: list[ScheduledSeq], device: torch.device) -> dict[str, torch.Tensor]:
    """Generator states, before this step's draws, of seeded sampling requests with drafts."""
    states = {}
    for seq in seqs:
        params = seq.request.sampling_params
        if seq.num_spec_tokens and params.seed is not None and not params.greedy:
            states[seq.request_id] = request_generator(seq.request, device).get_state()
    return states


def _rewind(request, state: torch.Tensor, num_draws: int, logits: torch.Tensor) -> None:
    """Put the request's generator where `num_draws` steps of plain decoding leave it: the
    state before this step, then the same draws (one Exp(1) row of the vocabulary each)."""
    gen = request_generator(request, logits.device)
    gen.set_state(state)
    row = torch.empty(logits.shape[1], dtype=torch.float32, device=logits.device)
    for _ in range(num_draws):
        row.exponential_(generator=gen)
