"""Beam search: the parameters and the per-prompt search state (pure Python, integers and
floats; the engine feeds it each beam's top candidates, computed on the device).

The rule is transformers' `generate(num_beams=k, do_sample=False, early_stopping=True)`:
each step takes the best K = max(2, 1 + #EOS) * k continuations over all beams by cumulative
log-probability; an EOS among the first k of them (or any continuation reaching max_tokens)
becomes a finished hypothesis scored cum_logprob / generated_len ** length_penalty; the best k
that did not finish run on. The search ends once k hypotheses are finished, or when every
continuation finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slipstream.sampling_params import MAX_LOGPROBS


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # beam search is deterministic: only 0 is accepted
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.beam_width > MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2}, got {self.beam_width}")
        if self.temperature != 0.0:
            raise ValueError("beam search takes temperature 0 only")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp:
            raise ValueError(f"length_penalty must be a number, got {lp!r}")

    def num_candidates(self, num_eos: int) -> int:
        """Continuations kept per step (transformers' beams_to_keep)."""
        return max(2, 1 + num_eos) * self.beam_width


@dataclass
class BeamSequence:
    """One finished hypothesis: its generated tokens (EOS included) and scores."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"
    tokens: list[int] = field(default_factory=list)  # prompt + output
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """The best hypotheses of one prompt, best first."""

    sequences: list[BeamSequence]


@dataclass
class BeamSearchUpdate:
    """One piece of a streamed search: tokens that every hypothesis now begins with (after
    those of earlier updates), or, last, the result."""

    settled_token_ids: list[int]
    output: BeamSearchOutput | None = None


class _Beam:
    """A running hypothesis: its last token and a link to the beam it extends, so a step
    costs O(1) per beam; the token list is built only for a finished hypothesis."""

    __slots__ = ("parent", "token", "score", "length")

    def __init__(self, parent: _Beam | None, token: int, score: float):
        self.parent, self.token, self.score = parent, token, score
        self.length = 0 if parent is None else parent.length + 1

    @property
    def tokens(self) -> list[int]:  # generated so far
        out, beam = [], self
        while beam.parent is not None:
            out.append(beam.token)
            beam = beam.parent
        return out[::-1]


def common_path(beams: list[_Beam], start: int) -> list[int]:
    """Tokens after the first `start` that every beam's path begins with."""
    if not beams:
        return []
    depth = min(b.length for b in beams)
    nodes = []
    for beam in beams:
        while beam.length > depth:
            beam = beam.parent
        nodes.append(beam)
    while len({id(b) for b in nodes}) > 1:
        nodes = [b.parent for b in nodes]
    tokens, node = [], nodes[0]
    while node.length > start:
        tokens.append(node.token)
        node = node.parent
    return tokens[::-1]


class BeamSearchState:
    """The search of one prompt. `step(candidates)` advances it by one token."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: tuple[int, ...] = ()):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = params.num_candidates(len(self.eos))
        self.running: list[_Beam] = [_Beam(None, -1, 0.0)]
        self.finished: list[BeamSequence] = []
        self.done = False

    def step(self, candidates: list[list[tuple[int, float]]]) -> list[tuple[int, int]]:
        """candidates[b]: (token, logprob) of running beam b, at least num_candidates of its
        best. Returns the next running beams as (parent beam index, token), best first."""
        if self.done:
            raise RuntimeError("the beam search is over")
        flat = [(beam.score + logprob, b, token)
                for b, beam in enumerate(self.running) for token, logprob in candidates[b]]
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        return self.advance(flat[: self.num_candidates])

    def advance(self, top: list[tuple[float, int, int]]) -> list[tuple[int, int]]:
        """Advance by the step's best continuations `top`: (cumulative logprob, parent beam,
        token), best first, num_candidates of them (`step`, or `step_many` for many searches).
        Returns the next running beams as (parent beam index, token), best first."""
        k, lp = self.params.beam_width, self.params.length_penalty
        gen_len = self.running[0].length + 1
        at_limit = gen_len >= self.params.max_tokens
        if top and not at_limit and self.eos.isdisjoint([token for _, _, token in top]):
            # Most steps: nothing finishes, the best k run on.
            running = self.running
            self.running = [_Beam(running[b], token, score) for score, b, token in top[:k]]
            return [(b, token) for _, b, token in top[:k]]
        hits = [at_limit or token in self.eos for _, _, token in top]
        if len(self.finished) < k:
            for (score, b, token), hit in zip(top[:k], hits[:k]):
                if hit:
                    self._add_finished(self.running[b].tokens + [token], score, gen_len ** lp,
                                       "stop" if token in self.eos else "length")
        chosen = [(b, token, score) for (score, b, token), hit in zip(top, hits) if not hit][:k]
        self.running = [_Beam(self.running[b], token, score) for b, token, score in chosen]
        self.done = len(self.finished) >= k or all(hits)
        return [(b, token) for b, token, _ in chosen]

    def _add_finished(self, tokens: list[int], cum: float, norm: float, reason: str) -> None:
        self.finished.append(BeamSequence(tokens, cum, cum / norm, reason))
        self.finished.sort(key=lambda s: -s.score)  # stable: earlier hypotheses win ties
        del self.finished[self.params.beam_width:]

    def result(self) -> BeamSearchOutput:
        return BeamSearchOutput(list(self.finished))


def step_many(states: list[BeamSearchState], rows: list[list[list[float]]]
              ) -> list[list[tuple[int, int]]]:
    """`state.step` for each search, from its beams' packed logprob rows (rows[i][b]: beam b's
    row of sampling/logprobs.py `pack_top_logprobs`, top-k ids then top-k values, k at least
    num_candidates). The choice of the best continuations is made for all searches at once:
    searches with as many beams and rows as wide are stacked into [searches, beams * K]
    arrays and ordered by one lexsort (cumulative logprob descending, then parent beam, then
    token: `step`'s order, in the same float64 arithmetic). Only each search's num_candidates
    winners reach Python."""
    results: list[list[tuple[int, int]] | None] = [None] * len(states)
    buckets: dict[tuple[int, int, int], list[int]] = {}
    for i, (state, beam_rows) in enumerate(zip(states, rows)):
        width = len(beam_rows[0]) if beam_rows else 0
        if state.done or width < 4 or any(len(r) != width for r in beam_rows):
            results[i] = state.step([_row_candidates(r, state.num_candidates) for r in beam_rows])
            continue
        buckets.setdefault((len(beam_rows), width, state.num_candidates), []).append(i)
    for (num_beams, width, num_top), members in buckets.items():
        packed = np.array([rows[i] for i in members], dtype=np.float64)  # [G, beams, width]
        k_packed = (width - 2) // 2
        k = min(num_top, k_packed)
        tokens = packed[:, :, 2 : 2 + k].astype(np.int64).reshape(len(members), -1)
        logprobs = packed[:, :, 2 + k_packed : 2 + k_packed + k]
        scores = np.array([[b.score for b in states[i].running] for i in members], np.float64)
        totals = (scores[:, :, None] + logprobs).reshape(len(members), -1)
        parents = np.broadcast_to(np.repeat(np.arange(num_beams), k), totals.shape)
        order = np.lexsort((tokens, parents, -totals), axis=-1)[:, :num_top]
        top_totals = np.take_along_axis(totals, order, -1).tolist()
        top_parents = (order // k).tolist()
        top_tokens = np.take_along_axis(tokens, order, -1).tolist()
        for row, i in enumerate(members):
            results[i] = states[i].advance(
                list(zip(top_totals[row], top_parents[row], top_tokens[row])))
    return results


def _row_candidates(row: list[float], k: int) -> list[tuple[int, float]]:
    """A packed logprob row's top-k (token, logprob), best first. The top-k come first in
    rank order; the sampled token, kept after them when it is not among them, is never
    needed: a greedy token outside the top-k ties with all of them, and ties keep the
    top-k's order."""
    k_packed = (len(row) - 2) // 2
    k = min(k, k_packed)
    return [(int(t), v) for t, v in zip(row[2 : 2 + k], row[2 + k_packed : 2 + k_packed + k])]
