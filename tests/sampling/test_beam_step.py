"""step_many (every ready search's choice in one vectorized pass over packed logprob rows)
against the rule written out plainly, ties included."""

from __future__ import annotations

import random

from slipstream.sampling.beam_search import BeamSearchParams, BeamSearchState, step_many


def _packed_row(rng: random.Random, vocab: int, k: int, k_packed: int) -> list[float]:
    """A row as sampling/logprobs.py packs it: sampled id, its logprob, k_packed top ids then
    their values (descending). Values come from a few levels, so ties are common."""
    ids = rng.sample(range(vocab), k_packed)
    vals = sorted((-rng.choice([0.5, 1.0, 1.25, 2.0, 3.5]) for _ in ids), reverse=True)
    return [float(ids[0]), vals[0], *map(float, ids), *vals]


class _Reference:
    """transformers' rule written out plainly (the oracle): the best num_candidates of all
    beams' continuations; EOS or the length limit among the first k finishes a hypothesis;
    the best k others run on."""

    def __init__(self, params: BeamSearchParams, eos: tuple[int, ...]):
        self.params, self.eos = params, set(eos)
        self.num_candidates = params.num_candidates(len(eos))
        self.running: list[tuple[list[int], float]] = [([], 0.0)]
        self.finished: list[tuple[list[int], float, float, str]] = []
        self.done = False

    def step(self, rows: list[list[float]]) -> list[tuple[int, int]]:
        k, n = self.params.beam_width, self.num_candidates
        flat = []
        for b, ((_tokens, score), row) in enumerate(zip(self.running, rows)):
            kp = (len(row) - 2) // 2
            flat += [(score + v, b, int(t)) for t, v in zip(row[2 : 2 + n], row[2 + kp : 2 + kp + n])]
        top = sorted(flat, key=lambda c: (-c[0], c[1], c[2]))[:n]
        gen_len = len(self.running[0][0]) + 1
        hits = [gen_len >= self.params.max_tokens or t in self.eos for _, _, t in top]
        for (score, b, t), hit in zip(top[:k], hits[:k]):
            if hit:  # a search still running has fewer than k: add, keep the best k
                reason = "stop" if t in self.eos else "length"
                norm = gen_len**self.params.length_penalty
                self.finished.append((self.running[b][0] + [t], score, score / norm, reason))
                self.finished.sort(key=lambda f: -f[2])
                del self.finished[k:]
        chosen = [(b, t, score) for (score, b, t), hit in zip(top, hits) if not hit][:k]
        self.running = [(self.running[b][0] + [t], score) for b, t, score in chosen]
        self.done = len(self.finished) >= k or all(hits)
        return [(b, t) for b, t, _ in chosen]


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
    reference = [_Reference(st.params, (5, 7)) for st in states]
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
            assert chosen == reference[i].step(beam_rows)
    for ours, ref in zip(states, reference):
        assert ours.done == ref.done
        assert [(b.tokens, b.score) for b in ours.running] == ref.running
        assert [
            (f.output_token_ids, f.cum_logprob, f.score, f.finish_reason) for f in ours.result().sequences
        ] == ref.finished
    assert sum(s.done for s in states) > 0 and sum(len(s.finished) for s in states) > 10


def test_common_path_is_the_shared_prefix_of_every_beam():
    from slipstream.sampling.beam_search import _Beam, common_path

    root = _Beam(None, -1, 0.0)
    a = _Beam(root, 7, -0.1)
    ab, ac = _Beam(a, 8, -0.2), _Beam(a, 9, -0.3)
    abd, ace = _Beam(ab, 1, -0.4), _Beam(ac, 2, -0.5)
    assert common_path([abd, ace], 0) == [7]
    assert common_path([abd, ace], 1) == []
    assert common_path([abd, _Beam(ab, 3, -0.6)], 0) == [7, 8]
    assert common_path([abd], 1) == [8, 1]
    assert common_path([], 0) == []
