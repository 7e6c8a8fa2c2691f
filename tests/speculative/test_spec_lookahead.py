"""Lookahead (Jacobi window + n-gram pool): the pool's bounds and order, merging branches into a
tree, the window's Jacobi update and the trajectories collected from every verification row,
drafts accepted on repetitive text with the same tokens as without speculation, and the
refusal on sliding-window models."""

from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams
from slipstream.engine.request import Request
from slipstream.scheduler.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from slipstream.serve.metrics import EngineStatsCollector
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.lookahead import LookaheadProposer, NgramPool, merge_chains
from slipstream.speculative.tree import check_parents, first_chain


def test_pool_is_bounded_and_most_recent_first():
    pool = NgramPool(n=3, per_key=2, max_keys=3)
    pool.add_all([1, 2, 3, 1, 4, 5, 1, 2, 3])
    # Key 1 saw (2, 3), (4, 5), then (2, 3) again: moved to the front, no duplicate.
    assert pool.continuations(1) == [(2, 3), (4, 5)]
    pool.add([1, 7, 7])
    assert pool.continuations(1) == [(7, 7), (2, 3)]  # per key: the 2 most recent
    for first in (8, 9, 10):
        pool.add([first, 0, 0])
    assert len(pool) == 3 and pool.continuations(1) == []  # least recently refreshed key dropped
    assert pool.continuations(10) == [(0, 0)]


def test_merge_chains_shares_prefixes_breadth_first():
    tokens, parents = merge_chains([[5, 6, 7], [5, 8], [9, 6], [5, 6, 7]])
    check_parents(parents)
    assert tokens == [5, 9, 6, 8, 6, 7]
    assert parents == [-1, -1, 0, 0, 1, 2]
    assert first_chain(tokens, parents) == [5, 6, 7]  # the first chain given stays first
    assert merge_chains([]) == ([], [])


def _request(tokens: list[int], prompt_len: int) -> Request:
    r = Request("r", tokens[:prompt_len], SamplingParams(temperature=0, max_tokens=64))
    r.output_token_ids.extend(tokens[prompt_len:])
    return r


def test_window_and_trajectories_from_every_row():
    prop = LookaheadProposer(window=3, ngram=3, candidates=2)
    r = _request([1, 2, 3, 1, 2, 4, 9, 1], prompt_len=5)
    ((tokens, parents),) = prop.propose([(r, 3)]).values()
    # Branches: what followed the latest earlier 1 (no longer suffix recurs): [2, 4, 9]; the
    # pool's continuations of 1, most recent first, extended by chaining n-grams: (2, 4) + 9
    # (the same again), (2, 3) + 1. The window starts as [2, 4, 9]. Shared prefixes merged.
    assert tokens == [2, 4, 3, 9, 1] and parents == [-1, 0, 0, 1, 2]
    state = prop._states["r"]
    assert state.chain == [2, 4, 9]
    # The target samples at every row: root, then nodes 2, 4, 3, 9, 1 (breadth-first).
    rows = [2, 5, 30, 31, 6, 40]  # root -> 2 accepted; node 2 -> 5, not a drafted child
    seq = ScheduledSeq(r, [1] + tokens, r.num_tokens - 1, [0], True, num_spec_tokens=5, spec_parents=parents)
    out = RunnerOutput(sampled_token_ids={"r": [2, 5]}, spec_row_token_ids={"r": rows})
    prop.observe_verification(SchedulerOutput(seqs=[seq]), out)
    # Trajectories: the branch's last N - 1 tokens and its row's sample.
    for gram in ([1, 2, 5], [2, 4, 30], [2, 3, 31], [4, 9, 6], [3, 1, 40]):
        assert tuple(gram[1:]) in state.pool.continuations(gram[0]), gram
    # Jacobi: the window chain 2, 4, 9 sampled 5, 30, 6 for the positions after each.
    assert (state.window_start, state.window) == (8, [2, 5, 30, 6])
    # Two tokens emitted (2, 5): the next proposal's window starts after them.
    r.output_token_ids.extend([2, 5])
    ((tokens, _),) = prop.propose([(r, 3)]).values()
    assert state.chain == [30, 6, 6]  # shifted, padded by repeating its last guess
    assert state.pool.continuations(1)[0] == (2, 5)  # the new output's n-grams, most recent
    prop.forget(["r"])
    assert "r" not in prop._states


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"lookahead_window": 0}, "lookahead_window"),
        ({"lookahead_ngram": 1}, "lookahead_ngram"),
        ({"lookahead_candidates": 17}, "lookahead_candidates"),
        ({"lookahead_candidates": 15, "num_speculative_tokens": 4}, "tree nodes"),
    ],
)
def test_bad_lookahead_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": "lookahead", "num_speculative_tokens": 3, **bad})


ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_seqs=4,
    max_num_tokens=64,
    max_model_len=160,
    kv_cache_memory=1 << 20,
    decode_steps=1,
)


def test_repetitive_text_accepts_drafts_with_the_same_tokens(tiny_checkpoint, monkeypatch):
    """A prompt that repeats a phrase: pool n-grams from the prompt are drafted; the output is
    the same as without speculation (greedy, beside a request with logprobs), and the proposer
    sees every verification's rows."""
    seen = []
    observe = LookaheadProposer.observe_verification
    monkeypatch.setattr(
        LookaheadProposer,
        "observe_verification",
        lambda self, s, r: (seen.append(dict(r.spec_row_token_ids)), observe(self, s, r)),
    )
    path = tiny_checkpoint("LlamaForCausalLM")
    unit = [17, 230, 41, 99, 5, 310]
    prompts = [unit * 8, [7, 300, 12, 45]]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
    ]
    want = [
        o.outputs[0].token_ids for o in LLM(str(path), **ENGINE).generate(prompts, params, use_tqdm=False)
    ]
    spec = {"method": "lookahead", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.get_stats()
    la = stats["speculative"]["lookahead"]
    assert la["num_accepted_tokens"] > 0 and la["mean_accepted_length"] > 1.0
    assert outs[0].metrics.num_accepted_tokens > 0
    # Every row comes back: the root's and each draft's, accepted or not.
    assert sum(len(rows) - 1 for step in seen for rows in step.values()) == la["num_draft_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    families = {f.name: f for f in EngineStatsCollector(lambda: stats).collect()}
    accepted = families["slipstream_spec_decode_num_accepted_tokens"].samples
    assert [(s.labels, s.value) for s in accepted if s.name.endswith("_total")] == [
        ({"method": "lookahead"}, la["num_accepted_tokens"])
    ]


def test_refused_on_sliding_window_models(tiny_checkpoint):
    windowed = tiny_checkpoint("MistralForCausalLM", sliding_window=8)
    with pytest.raises(ValueError, match="lookahead"):
        LLM(
            str(windowed),
            device="cpu",
            dtype="float32",
            max_model_len=64,
            speculative_config={"method": "lookahead", "num_speculative_tokens": 2},
        )


def test_adaptive_acceptance_counts_positions_tried_not_tree_nodes():
    """A chain of 4 with 2 accepted tried 3 positions; a depth-2 tree of 5 nodes accepted to
    its depth tried 2: a = 4 / 5 (accepted over verified nodes would say 4 / 9)."""
    from slipstream.speculative.decoder import _EMA_WEIGHT, SpeculativeDecoder

    dec = SpeculativeDecoder(
        SpeculativeConfig.from_dict({"method": "lookahead", "num_speculative_tokens": 4}), None, 64
    )
    dec.acceptance = 0.0
    chain = ScheduledSeq(_request([1, 2], 2), [2, 3, 4, 5, 6], 1, [0], True, num_spec_tokens=4)
    tree = ScheduledSeq(
        _request([1, 2], 2),
        [2, 3, 4, 5, 6, 7],
        1,
        [0],
        True,
        num_spec_tokens=5,
        spec_parents=[-1, -1, 0, 0, 1],
    )
    tree.request.request_id = "t"
    out = RunnerOutput(sampled_token_ids={"r": [3, 4, 9], "t": [3, 5, 8]})
    assert dec.record(SchedulerOutput(seqs=[chain, tree]), out) == {"r": (4, 2), "t": (5, 2)}
    assert dec.acceptance == pytest.approx(_EMA_WEIGHT * 4 / 5)
    assert dec.stats.num_draft_tokens == 9 and dec.stats.num_accepted_tokens == 4


def test_aborted_requests_leave_no_proposer_state(tiny_checkpoint):
    llm = LLM(
        str(tiny_checkpoint("LlamaForCausalLM")),
        speculative_config={"method": "lookahead", "num_speculative_tokens": 2, "adaptive": False},
        **ENGINE,
    )
    core = llm.engine
    for rid in ("a", "b"):
        core.add_request(Request(rid, [5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=30)))
    for _ in range(4):
        core.step()
    states = core.spec.proposer._states
    assert set(states) == {"a", "b"}
    core.abort_requests(["a"])
    assert set(states) == {"b"}
