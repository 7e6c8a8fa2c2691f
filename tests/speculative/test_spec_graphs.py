"""Verification steps through the prefill graphs' padded batch: draft trees (their attention bit
sets staged beside the batch) and the target's hidden states for Medusa / EAGLE (read back from
the graphs' static buffer; EAGLE-3's auxiliary layers from the buffers its hooks copy into).

On the CPU nothing is captured and PrefillGraphs runs its padded batch eagerly, so this checks
the staging: the same greedy tokens as without speculation, the same hidden states handed to the
proposer as the eager path gives, and that the verify steps really took the padded path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.runner import model_runner
from slipstream.speculative import oracle
from tests.speculative.heads import write_eagle, write_medusa

# No prefix caching: the second run of the prompts schedules the same steps as the first.
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_seqs=4,
    max_model_len=160,
    kv_cache_memory=1 << 20,
    decode_steps=1,
    enable_prefix_caching=False,
)
PROMPTS = [[17, 230, 41, 99, 5, 310] * 4, [9, 10, 11, 12, 13]]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="module")
def want(target):
    """Greedy tokens without speculation."""
    outs = LLM(str(target), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _spec_config(method: str, target, tmp_path) -> dict:
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "oracle_tree":
        spec |= {"method": "oracle", "speculative_token_tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}
    if method == "medusa":
        spec["model"] = str(write_medusa(tmp_path / "m", target))
    if method.startswith("eagle"):
        spec |= {
            "method": method.removesuffix("_tree"),
            "speculative_token_tree": [[0], [1], [0, 0], [0, 0, 0]],
        }
        spec["model"] = str(write_eagle(tmp_path / "e", target, eagle3=method == "eagle3_tree"))
    return spec


def _observed(llm: LLM) -> list[torch.Tensor]:
    """Spy on the proposer's observe: the features (hidden states; EAGLE-3: its fused auxiliary
    layers' inputs) of the tokens each step made known."""
    proposer, seen = llm.engine.spec.proposer, []
    observe = proposer.observe

    def spy(step):
        feats = proposer.features(step) if hasattr(proposer, "features") else step.hidden
        seen.append(torch.cat([feats[rows] for rows in step.known_rows.values()]).clone())
        observe(step)

    proposer.observe = spy
    return seen


@pytest.mark.parametrize("method", ["lookahead", "oracle_tree", "medusa", "eagle_tree", "eagle3_tree"])
def test_verify_steps_through_padded_graph_batch(target, want, tmp_path, monkeypatch, method):
    """Each run's verification logits too: a tiny random model's greedy tokens barely depend
    on what a tree node attends to, its logits do."""
    verify_logits, verify = [], model_runner.verify_into
    monkeypatch.setattr(
        model_runner,
        "verify_into",
        lambda out, s, logits, seqs: (verify_logits.append(logits.clone()), verify(out, s, logits, seqs))[1],
    )
    if method == "oracle_tree":
        oracle.set_reference_outputs({tuple(p): w for p, w in zip(PROMPTS, want)})
    llm = LLM(str(target), speculative_config=_spec_config(method, target, tmp_path), **ENGINE)
    runner = llm.engine.runner
    keep_hidden = runner.keep_hidden
    assert keep_hidden == (method in ("medusa", "eagle_tree", "eagle3_tree"))
    seen = _observed(llm) if keep_hidden else []
    eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    eager_hidden, seen[:] = list(seen), []
    eager_logits, verify_logits[:] = list(verify_logits), []

    if method == "oracle_tree":  # the same drafts again
        llm.engine.spec.proposer._rng.seed(0)
    graphs = runner._prefill_graphs = runner.new_prefill_graphs(64)
    assert graphs.tree_mask is not None and graphs.keep_hidden == keep_hidden
    verified, run = [], graphs.run

    def counting(hb, feed=None):
        if len(hb.logits_indices) > len(hb.sample_seq_indices):  # draft tokens verified
            verified.append(hb.tree_mask is not None)
        return run(hb, feed)

    graphs.run = counting
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == eager == want
    assert sum(verified) > 0, "no draft tree went through the padded graph batch"
    assert len(verify_logits) == len(eager_logits) == len(verified), "a verification ran eagerly"
    for a, b in zip(verify_logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if keep_hidden:  # the same steps, the same hidden states for the proposer
        assert len(seen) == len(eager_hidden) > len(verified)  # prefills too
        for a, b in zip(seen, eager_hidden):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if method in ("lookahead", "oracle_tree"):
        assert llm.get_stats()["spec_num_accepted_tokens"] > 0


def test_graph_logit_rows_cover_the_largest_draft(tmp_path):
    """A captured step returns k + 1 logits rows a request, k the most draft tokens or tree
    nodes the method verifies (a verification with more rows would run eagerly)."""
    from slipstream.runner.model_runner import _verify_rows, max_sampled_rows
    from slipstream.speculative.config import SpeculativeConfig

    def nodes(**spec) -> int:
        return SpeculativeConfig.from_dict({"num_speculative_tokens": 3, **spec}).max_draft_tokens

    assert nodes(method="ngram") == 3
    assert nodes(method="lookahead", lookahead_candidates=2) == 9
    assert nodes(method="oracle", speculative_token_tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]) == 5
    assert nodes(method="medusa", model=str(tmp_path)) == 15
    config = SimpleNamespace(
        speculative=SpeculativeConfig.from_dict({"method": "lookahead", "num_speculative_tokens": 4}),
        grammar_forced_drafts=0,
        scheduler=SimpleNamespace(max_num_seqs=4, max_num_tokens=8192),
    )
    assert _verify_rows(config) == 4 * (20 + 1)
    config.scheduler.max_num_seqs = 64
    assert _verify_rows(config) == 256
    # The start-up memory profile reserves the sampler's temporaries for every row, uncapped.
    assert max_sampled_rows(config) == 64 * 21
    config.speculative, config.grammar_forced_drafts = None, 8
    assert max_sampled_rows(config) == 64 * 9
    config.scheduler.max_num_tokens = 256  # a step verifies at most its token budget
    assert max_sampled_rows(config) == 256
    config.grammar_forced_drafts = 0
    assert max_sampled_rows(config) == 64 and _verify_rows(config) is None
