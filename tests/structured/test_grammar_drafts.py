"""Grammar-forced drafts: a constrained request verifies the tokens its grammar forces as drafts.
The derivation returns the forced continuation and leaves the matcher where it was; the
verification rows' masks follow the drafts; and end to end the outputs are token for token
those of constrained decoding without drafts (greedy and seeded, in a mixed batch with
unconstrained and n-gram-speculating requests), in fewer engine steps, with no KV leaked."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.structured import StructuredOutputsParams as SO
from slipstream.structured.bitmask import bitmask_words
from slipstream.structured.grammar import RequestGrammar
from slipstream.structured.manager import StructuredOutputManager

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99},
        "subscription_status_description": {"enum": ["currently_active", "suspended_for_review"]},
        "has_outstanding_balance": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "subscription_status_description", "has_outstanding_balance"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "priority_level": {"enum": ["low", "high"]},
                "quantity": {"type": "integer", "maximum": 9},
            },
            "required": ["priority_level", "quantity"],
        },
        "tags": {"type": "array", "items": {"enum": ["fragile", "express"]}, "maxItems": 2},
    },
    "required": ["order", "tags"],
}
REGEX = r"ORDER-[0-9]{2}-(alpha|omega)-END"
CHOICES = ["the first possible answer", "another entirely different answer"]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, max_num_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def manager(tiny_chat_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_chat_model_dir).vocab_size
    return StructuredOutputManager(str(tiny_chat_model_dir), vocab)


def _grammar(manager, so: SO) -> RequestGrammar:
    compiled = manager.compile(so).result(timeout=60)
    return RequestGrammar(compiled, (), manager.encode)


def _mask(grammar: RequestGrammar, vocab: int) -> torch.Tensor:
    out = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    grammar.fill_bitmask(out, 0)
    return out


def test_forced_drafts_are_the_forced_text_and_roll_back(manager):
    grammar = _grammar(manager, SO(choice=["exactly_this_answer"]))
    tokenizer = manager._tokenizer
    vocab = manager._vocab_size
    before = _mask(grammar, vocab)
    drafts = grammar.forced_drafts(40)
    assert tokenizer.decode(drafts) == "exactly_this_answer"  # the whole answer is forced
    assert torch.equal(_mask(grammar, vocab), before)  # rolled back
    assert grammar.forced_drafts(3) == drafts[:3]

    regex = _grammar(manager, SO(regex=REGEX))
    drafts = regex.forced_drafts(16)
    assert tokenizer.decode(drafts) == "ORDER-"  # forced up to the first free character
    for token in drafts:  # the drafts are the tokens constrained decoding can take
        assert regex.matcher.accept_token(token)
    assert regex.forced_drafts(16) == []  # a digit: free
    regex.rollback(len(drafts))
    # A tokenizer whose split starts with a token the grammar forbids (a prefixed space):
    # xgrammar's own tokenization of the forced string instead.
    space = tokenizer.encode(" ")[0]
    compiled = manager.compile(SO(regex=REGEX)).result()
    spaced = RequestGrammar(compiled, (), lambda text: [space, *manager.encode(text)])
    assert tokenizer.decode(spaced.forced_drafts(16)) == "ORDER-"


def test_verification_rows_follow_the_drafts(manager):
    grammar = _grammar(manager, SO(json=LONG_KEYS))
    vocab = manager._vocab_size
    drafts = grammar.forced_drafts(6)
    assert len(drafts) == 6
    rows = torch.zeros(len(drafts) + 1, bitmask_words(vocab), dtype=torch.int32)
    grammar.fill_bitmask_along(rows, 0, drafts)
    for j, token in enumerate([*drafts, None]):
        assert torch.equal(rows[j : j + 1], _mask(grammar, vocab))
        if token is not None:
            assert grammar.matcher.accept_token(token)
    grammar.rollback(len(drafts))
    # A draft the grammar rejects: the rows after it repeat its row's mask.
    bad = [drafts[0], 0, drafts[2]]
    rows = torch.zeros(4, bitmask_words(vocab), dtype=torch.int32)
    grammar.fill_bitmask_along(rows, 0, bad)
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])
    assert torch.equal(rows[0:1], _mask(grammar, vocab))


def _workload():
    prompts = [[5 + i, 17, 33 + 2 * i, 40, 41, 42, 43][: 3 + i % 4] for i in range(8)]
    constrained = [SO(json=LONG_KEYS), SO(json=NESTED), SO(regex=REGEX), SO(choice=CHOICES)]
    constrained.append(SO(json=LONG_KEYS))
    params = []
    for i, so in enumerate(constrained):
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, seed=10 + i)
        params.append(SamplingParams(max_tokens=200, structured_outputs=so, **sampling))
    repeat = [7, 8, 9, 10] * 4  # n-gram lookup finds drafts here
    prompts[5] = repeat
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params.append(SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True))
    params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1))
    return prompts, params


def _run(llm: LLM):
    return _generate_counting_steps(llm, *_workload())


def _generate_counting_steps(llm: LLM, prompts, params):
    """The outputs, and how many engine steps produced them."""
    engine, steps = llm.engine, []
    step = engine.step
    engine.step = lambda *a, **kw: steps.append(1) or step(*a, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step
    return outs, len(steps)


@pytest.fixture(scope="module")
def without_drafts(tiny_chat_model_dir):
    return _run(LLM(str(tiny_chat_model_dir), grammar_forced_drafts=0, **ENGINE))


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}])
def test_same_tokens_in_fewer_steps(tiny_chat_model_dir, without_drafts, spec):
    want, plain_steps = without_drafts
    llm = LLM(str(tiny_chat_model_dir), grammar_forced_drafts=8, speculative_config=spec, **ENGINE)
    got, steps = _run(llm)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    # The schema outputs are what the constraint says.
    for i in (0, 4):
        assert set(json.loads(got[i].outputs[0].text)) == set(LONG_KEYS["properties"])
    assert got[3].outputs[0].text in CHOICES
    stats = llm.get_stats()
    assert stats["grammar_num_accepted_tokens"] > 0
    assert got[0].metrics.num_accepted_tokens > 0
    assert sum(o.metrics.num_accepted_tokens for o in got[:5]) == stats["grammar_num_accepted_tokens"]
    if spec is not None:  # the n-gram proposer drafts for the unconstrained ones only
        assert stats["speculative"]["ngram"]["num_draft_tokens"] > 0
        assert stats["spec_num_draft_tokens"] == sum(o.metrics.num_draft_tokens for o in got[5:])
    assert steps < plain_steps
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_long_fixed_keys_take_fewer_steps(tiny_chat_model_dir, without_drafts):
    """One greedy request with long keys alone: a step per forced stretch, not per token."""
    counts = {}
    for k in (0, 8):
        llm = LLM(str(tiny_chat_model_dir), grammar_forced_drafts=k, **ENGINE)
        params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=SO(json=LONG_KEYS))
        outs, steps = _generate_counting_steps(llm, [[5, 6, 7]], params)
        counts[k] = (steps, outs[0].outputs[0].token_ids)
    assert counts[0][1] == counts[8][1]
    assert counts[8][0] < 0.6 * counts[0][0], counts


@pytest.mark.gpu
def test_same_tokens_on_cuda(tiny_chat_model_dir):
    """Pinned mask buffers filled along the drafts, copied and applied on the device, prefill
    graphs returning the verification rows; against constrained decoding without drafts
    (async steps on, as CUDA's default)."""
    engine = dict(ENGINE, device="cuda", kv_cache_memory=64 << 20)
    want, plain_steps = _run(LLM(str(tiny_chat_model_dir), grammar_forced_drafts=0, **engine))
    got, steps = _run(LLM(str(tiny_chat_model_dir), grammar_forced_drafts=8, **engine))
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    assert steps < plain_steps


def test_knob_is_checked():
    from slipstream.engine.args import EngineArgs

    with pytest.raises(ValueError, match="grammar_forced_drafts"):
        EngineArgs(grammar_forced_drafts=-1).create_engine_config()
