"""On a GPU (CUDA graphs, the Triton kernels, verification through the prefill graphs): the
same greedy tokens with and without speculation, every verification step (chains, draft
trees, steps keeping hidden states for Medusa / EAGLE / EAGLE-3) replayed from a prefill graph,
and the features a head proposer reads from a replay equal to an eager engine's."""

from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.runner import model_runner
from slipstream.speculative import oracle
from tests.speculative.heads import write_eagle, write_medusa

PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11, 12, 13], list(range(20, 60))]
SP = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
KW = dict(dtype="float32", device="cuda", max_num_seqs=8, max_model_len=256, kv_cache_memory=64 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "method",
    ["ngram", "lookahead", "oracle", "oracle_tree", "draft_model", "medusa", "eagle", "eagle3", "eagle_tree"],
)
def test_gpu_greedy_equal_with_speculation(tiny_checkpoint, tmp_path, monkeypatch, method):
    path = tiny_checkpoint("LlamaForCausalLM")
    base = LLM(str(path), **KW)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, SP, use_tqdm=False)]
    del base
    oracle.set_reference_outputs({tuple(p): w for p, w in zip(PROMPTS, want)})
    llm = LLM(str(path), speculative_config=_spec(method, path, tmp_path), **KW)
    verify_steps, verify_replays = _count_verify_replays(llm, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    assert got == want
    assert verify_steps and len(verify_replays) == len(verify_steps) and all(n == 1 for n in verify_replays)
    if not method.startswith(("medusa", "eagle")):  # random heads may never be right
        assert llm.get_stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "eagle_tree"])
def test_gpu_features_from_graphs_equal_eager(tiny_checkpoint, tmp_path, method):
    """The features (hidden states; EAGLE-3: its fused auxiliary layers' inputs) the proposer
    reads for each known position, from replayed steps and from an enforce_eager engine: the
    drafts of random heads may all be wrong, so the tokens alone would not tell."""
    path = tiny_checkpoint("LlamaForCausalLM")
    feats = {}
    for eager in (False, True):
        llm = LLM(str(path), speculative_config=_spec(method, path, tmp_path), enforce_eager=eager, **KW)
        feats[eager] = _features_by_position(llm)
        llm.generate(PROMPTS, SP, use_tqdm=False)
        del llm
    common = sorted(feats[False].keys() & feats[True].keys())
    assert len(common) > 100
    for key in common:
        torch.testing.assert_close(feats[False][key], feats[True][key], rtol=1e-2, atol=1e-2)


def _spec(method: str, path, tmp_path) -> dict:
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(path)
    if method == "oracle_tree":  # tree verification through the compiled tree mask
        spec |= {"method": "oracle", "speculative_token_tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}
    if method == "medusa":
        spec["model"] = str(write_medusa(tmp_path / "m", path))
    if method == "eagle_tree":  # the top-1 chain and next-ranked leaves
        spec |= {"method": "eagle", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]}
    if spec["method"] in ("eagle", "eagle3"):
        spec["model"] = str(write_eagle(tmp_path / "e", path, eagle3=method == "eagle3"))
    return spec


def _features_by_position(llm: LLM) -> dict[tuple, torch.Tensor]:
    """Spy on the proposer's observe: {(prompt, position): feature} of every known token."""
    proposer, seen = llm.engine.spec.proposer, {}
    observe = proposer.observe

    def spy(step):
        feats = proposer.features(step) if hasattr(proposer, "features") else step.hidden
        for seq in step.seqs:
            prompt = tuple(seq.request.prompt_token_ids)
            for j, row in enumerate(step.known_rows[seq.request_id]):
                seen[(prompt, seq.start_pos + j)] = feats[row].float().cpu()
        observe(step)

    proposer.observe = spy
    return seen


def _count_verify_replays(llm: LLM, monkeypatch) -> tuple[list[int], list[int]]:
    """(one entry per verification step, the prefill-graph replays of each verification batch
    the graphs ran)."""
    steps, replays = [], []
    verify = model_runner.verify_into

    def counted_verify(out, sampler, logits, seqs):
        steps.append(1)
        return verify(out, sampler, logits, seqs)

    monkeypatch.setattr(model_runner, "verify_into", counted_verify)
    graphs = llm.engine.runner._prefill_graphs
    if graphs is None:
        return steps, replays
    run = graphs.run

    def counted_run(hb, feed=None):
        before = graphs.replays
        logits = run(hb, feed)
        if len(hb.logits_indices) > len(hb.sample_seq_indices):  # draft tokens verified
            replays.append(graphs.replays - before)
        return logits

    graphs.run = counted_run
    return steps, replays
