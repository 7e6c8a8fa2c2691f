"""Speculative decoding end to end on tiny random models: the same tokens as decoding without
it (greedy, seeded sampling, logprobs, stops, penalties, n > 1, chunked prefill, prefix hits,
preemption) for every method, with speculating and plain requests in one batch; and sampled
token frequencies that follow the target distribution (chi-square)."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.speculative import oracle
from tests.helpers import load_hf_model
from tests.speculative.heads import write_eagle, write_medusa

# Small cache and budget: chunked prefill beside verification, waiting requests, preemption.
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_seqs=4,
    max_num_tokens=32,
    max_model_len=128,
    kv_cache_memory=160 << 10,
    decode_steps=1,
)


def _workload():
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # prefix-cache hits (a full block)
    prompts, params = [], []
    for i in range(10):
        if i % 3 == 0:  # repeats itself: n-gram lookup finds drafts
            unit = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 5))]
            prompt = (unit * 12)[: rng.randrange(10, 40)]
        elif i % 3 == 1:
            prompt = shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 8))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]
        prompts.append(prompt)
    n = lambda: rng.randrange(8, 40)  # noqa: E731
    params = [
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=11, max_tokens=n(), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=n(), stop_token_ids=[7, 9, 300]),
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=5, top_k=20, max_tokens=n(), ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True, min_tokens=6),
        SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=n(), ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=n(), ignore_eos=True),
    ]
    return prompts, params


def _run(llm: LLM):
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], outs


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(str(target), **ENGINE)
    results, _ = _run(llm)
    prompts, _ = _workload()
    # The oracle proposer's "target's own next tokens": greedy/seeded outputs of this run.
    oracle.set_reference_outputs({tuple(p): r[0][0] for p, r in zip(prompts, results)})
    return results


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        "medusa": write_medusa(root / "medusa", target, num_heads=3),
        "eagle": write_eagle(root / "eagle", target),
        "eagle3": write_eagle(root / "eagle3", target, eagle3=True),
    }


def _spec_configs(tiny_checkpoint, heads=None):
    draft = tiny_checkpoint("LlamaForCausalLM", num_hidden_layers=1, seed=3)
    # A tree with its right branch at a random rank: accepted paths off the first chain move
    # their K/V into place.
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [1, 0, 0], [1, 0, 1]]
    return {
        "oracle_tree": {
            "method": "oracle",
            "num_speculative_tokens": 3,
            "acceptance_rate": 0.8,
            "speculative_token_tree": tree,
        },
        **{
            m: {"method": m, "model": str(heads[m]), "num_speculative_tokens": 3}
            for m in ("medusa", "eagle", "eagle3")
        },
        "eagle3_tree": {
            "method": "eagle3",
            "model": str(heads["eagle3"]),
            "num_speculative_tokens": 3,
            "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]],
        },
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "lookahead": {"method": "lookahead", "num_speculative_tokens": 3, "lookahead_ngram": 3},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "draft_is_target": {"method": "draft_model", "num_speculative_tokens": 4},
        "oracle": {"method": "oracle", "num_speculative_tokens": 4, "acceptance_rate": 0.7},
    }


@pytest.mark.parametrize(
    "name",
    [
        "ngram",
        "lookahead",
        "draft_model",
        "draft_is_target",
        "oracle",
        "oracle_tree",
        "medusa",
        "eagle",
        "eagle3",
        "eagle3_tree",
    ],
)
def test_same_tokens_as_without_speculation(tiny_checkpoint, target, reference, heads, name):
    config = dict(_spec_configs(tiny_checkpoint, heads)[name], adaptive=False)
    if name == "draft_is_target":
        config["model"] = str(target)
    llm = LLM(str(target), speculative_config=config, **ENGINE)
    results, outs = _run(llm)
    for got, want in zip(results, reference, strict=True):
        for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
            assert ids == ref_ids
            if ref_lps is not None:
                for a, b in zip(lps, ref_lps, strict=True):
                    assert a.keys() == b.keys()
                    assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    stats = llm.get_stats()
    spec = stats["speculative"][config["method"]]
    assert spec["num_draft_tokens"] > 0
    if not name.startswith(("draft_model", "medusa", "eagle")):  # random drafts may never be right
        assert spec["num_accepted_tokens"] > 0
    assert stats["spec_num_draft_tokens"] == spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    # Per request: the drafts verified and accepted add up to the engine's totals.
    assert sum(o.metrics.num_accepted_tokens for o in outs) == spec["num_accepted_tokens"]
    assert sum(o.metrics.num_draft_tokens for o in outs) == spec["num_draft_tokens"]
    # Penalties and a pending min_tokens keep a request out of speculation entirely.
    assert outs[4].metrics.num_draft_tokens == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if name == "draft_is_target":  # greedy drafts of the target itself: all accepted
        assert outs[0].metrics.num_accepted_tokens == outs[0].metrics.num_draft_tokens > 0
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("method", ["draft_model", "lookahead"])
def test_chi_square_sampled_tokens_follow_target(tiny_checkpoint, method):
    """Tokens 2 and 3 of 3000 samples at temperature 1 against their exact marginals from
    transformers. Drafts: the target's own greedy tokens, or a lookahead tree whose first
    level holds about five of the twelve tokens whatever the token before (the prompt
    follows each token by many others), so a rule that accepted drafts too often would pile
    up on them."""
    path = tiny_checkpoint("LlamaForCausalLM", vocab_size=12, initializer_range=0.3, seed=4)
    spec = {"method": method, "num_speculative_tokens": 2, "adaptive": False}
    if method == "draft_model":
        prompt, spec["model"], max_tokens = [3, 4, 5], str(path), 3
    else:  # room for the tree's nodes: the scheduler fits them in max_tokens
        prompt, max_tokens = _many_pairs(12, 64), 5
        spec |= {"lookahead_ngram": 2, "lookahead_candidates": 4}
    num = 3000
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_num_seqs=256,
        max_model_len=len(prompt) + 8,
        kv_cache_memory=4 << 20,
        speculative_config=spec,
    )
    outs = llm.generate(
        [prompt] * num,
        SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    assert llm.get_stats()["spec_num_accepted_tokens"] > num // 4
    samples = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    p2, p3 = _exact_marginals(load_hf_model(path), prompt, 12)
    for pos, p in ((1, p2), (2, p3)):
        counts = torch.bincount(samples[:, pos], minlength=12).double()
        expected = p.double() * num
        keep = expected >= 5  # chi-square needs enough expected counts per cell
        stat = (((counts - expected) ** 2) / expected)[keep].sum()
        stat += (
            ((counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
            if (~keep).any()
            else 0.0
        )
        dof = int(keep.sum()) - (0 if (~keep).any() else 1)
        p_value = torch.special.gammaincc(torch.tensor(dof / 2), stat / 2).item()
        assert p_value > 1e-3, (pos, p_value, counts.tolist(), expected.tolist())


def _many_pairs(vocab: int, length: int) -> list[int]:
    """`length` tokens in a random order that repeats no pair: each token is followed by
    several others, the most recent ones differing from token to token."""
    rng, seq, seen = random.Random(0), [0], set()
    while len(seq) < length:
        unseen = [b for b in range(vocab) if (seq[-1], b) not in seen]
        if not unseen:
            return seq
        seq.append(rng.choice(unseen))
        seen.add((seq[-2], seq[-1]))
    return seq


@torch.no_grad()
def _exact_marginals(model, prompt: list[int], vocab: int):
    """P(token 2) and P(token 3) of a prompt's continuation, summing over tokens 1 (and 2)."""

    def probs(prefixes):
        return model(torch.tensor(prefixes)).logits[:, -1].float().softmax(-1)

    p1 = probs([prompt])[0]
    p2_given = probs([prompt + [a] for a in range(vocab)])  # [a, b]
    p3_given = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    joint12 = p1[:, None] * p2_given
    p3 = (joint12.reshape(-1, 1) * p3_given).sum(0)
    return joint12.sum(0), p3
