"""step_many (every ready search's choice in one vectorized pass over packed logprob rows)
against BeamSearchState.step (the per-search reference), ties included."""

from __future__ import annotations

import copy
import random

from slipstream.sampling.beam_search import BeamSearchParams, BeamSearchState, step_many


def _packed_row(rng: random.Random, vocab: int, k: int, k_packed: int) -> list[float]:
    """A row as sampling/logprobs.py packs it: sampled id, its logprob, k_packed top ids then
    their values (descending). Values come from a few levels, so ties are common."""
    ids = rng.sample(range(vocab), k_packed)
    vals = sorted((-rng.choice([0.5, 1.0, 1.25, 2.0, 3.5]) for _ in ids), reverse=True)
    return [float(ids[0]), vals[0], *map(float, ids), *vals]


def _reference(state: BeamSearchState, rows: list[list[float]]) -> list[tuple[int, int]]:
    k = state.num_candidates
    cands = []
    for row in rows:
        kp = (len(row) - 2) // 2
        cands.append([(int(t), v) for t, v in zip(row[2 : 2 + k], row[2 + kp : 2 + kp + k])])
    return state.step(cands)


def test_step_many_matches_step_per_search():
    rng = random.Random(0)
    width, vocab = 3, 12  # eos 5 and 7 are often among the candidates
    states = [
        BeamSearchState(
            BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=rng.choice([0.5, 1.0, 2.0])),
            eos_token_ids=(5, 7),
        )
        for _ in range(24)
    ]
    reference = copy.deepcopy(states)
    for _ in range(6):
        live = [i for i, s in enumerate(states) if not s.done]
        if not live:
            break
        # Most rows packed with the search's K; a few with more (a batch whose other request
        # asked for more logprobs), which puts such searches in their own bucket.
        rows = [
            [
                _packed_row(rng, vocab, states[i].num_candidates, states[i].num_candidates + (i % 5 == 0))
                for _ in states[i].running
            ]
            for i in live
        ]
        got = step_many([states[i] for i in live], rows)
        for i, chosen, beam_rows in zip(live, got, rows):
            assert chosen == _reference(reference[i], beam_rows)
    for ours, ref in zip(states, reference):
        assert ours.done == ref.done
        assert [(b.tokens, b.score) for b in ours.running] == [(b.tokens, b.score) for b in ref.running]
        assert ours.result() == ref.result()
    assert sum(s.done for s in states) > 0 and sum(len(s.finished) for s in states) > 10
