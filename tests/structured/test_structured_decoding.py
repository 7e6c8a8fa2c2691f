"""Constrained decoding end to end (offline API): every output of a JSON schema, regex,
choice or grammar request parses and validates, on the default model and on a random tiny one,
with sampling, n > 1 and stop strings; the logit controls do what they say."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from slipstream import LLM, SamplingParams
from slipstream.assets import DEFAULT_MODEL_DIR
from slipstream.structured import StructuredOutputsParams as SO
from tests.structured.schemas import random_object_schemas

ARITH = """
root ::= expr
expr ::= term (op term)? (op term)?
term ::= num | "(" num op num ")"
op ::= "+" | "-"
num ::= [1-9] [0-9]?
"""
ARITH_RE = r"[\d()+-]+"  # eval() below is the real check


def _llm(path) -> LLM:
    return LLM(
        str(path), dtype="float32", device="cpu", max_model_len=1024, max_num_tokens=512, max_num_seqs=64
    )


@pytest.fixture(scope="module")
def default_llm():
    return _llm(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def random_llm(tiny_chat_model_dir):
    return _llm(tiny_chat_model_dir)


def _params(i: int, so: SO, **kw) -> SamplingParams:
    """Alternate greedy and seeded sampling; every third with n=2, every fourth with a stop
    string the constraint never produces."""
    sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.95, seed=i)
    extra = dict(n=2) if i % 3 == 0 and i % 2 == 0 else {}
    if i % 4 == 1:
        extra["stop"] = ["<<end>>"]
    return SamplingParams(max_tokens=400, structured_outputs=so, **sampling, **extra, **kw)


@pytest.mark.parametrize("which", ["default_llm", "random_llm"])
def test_every_output_follows_its_constraint(which, request):
    llm = request.getfixturevalue(which)
    schemas = random_object_schemas(seed=45, count=10)
    cases = [("json", s, SO(json=s)) for s in schemas]
    cases += [
        ("regex", r"[a-z]{2,5}-\d{1,3}", SO(regex=r"[a-z]{2,5}-\d{1,3}")),
        ("choice", ["alpha", "beta gamma", 'quote"d'], SO(choice=["alpha", "beta gamma", 'quote"d'])),
        ("grammar", None, SO(grammar=ARITH)),
    ]
    params = [_params(i, so) for i, (_, _, so) in enumerate(cases)]
    if which == "default_llm":  # any object has unbounded strings: only a trained model ends it
        cases.append(("json_object", None, SO(json_object=True)))
        params.append(SamplingParams(temperature=0, max_tokens=400, structured_outputs=SO(json_object=True)))
    outs = llm.generate(["def parse(data):"] * len(cases), params, use_tqdm=False)
    for (kind, spec, _), out, sp in zip(cases, outs, params):
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, spec, c.text)
            if kind == "json":
                jsonschema.validate(json.loads(c.text), spec)
            elif kind == "json_object":
                assert isinstance(json.loads(c.text), dict), c.text
            elif kind == "regex":
                assert re.fullmatch(spec, c.text), c.text
            elif kind == "choice":
                assert c.text in spec
            else:
                assert re.fullmatch(ARITH_RE, c.text), c.text
                eval(compile(c.text, "<grammar output>", "eval"), {"__builtins__": {}})


def test_constraint_errors_name_the_field():
    with pytest.raises(ValueError, match=r"structured_outputs\.json: .*"):
        SamplingParams(structured_outputs=SO(json={"type": "bogus"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*parenthesis"):
        SamplingParams(structured_outputs=SO(regex="a(b"))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar: .*not defined"):
        SamplingParams(structured_outputs=SO(grammar="root ::= undefined_rule"))
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))
    # The dict form (what crosses to the server's engine process) rebuilds the same params.
    sp = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert sp.structured_outputs.json == {"type": "object"}


def test_logit_bias_allowed_and_bad_words(default_llm):
    prompt = "def add(a, b):"
    base = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
        0
    ].outputs[0]
    forced = 1234
    biased, allowed, banned = default_llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100.0}),
            SamplingParams(temperature=0.9, seed=0, max_tokens=12, allowed_token_ids=[300, 301]),
            SamplingParams(temperature=0, max_tokens=12, bad_words_token_ids=[[base.token_ids[0]]]),
        ],
        use_tqdm=False,
    )
    assert biased.outputs[0].token_ids == [forced] * 4
    assert set(allowed.outputs[0].token_ids) <= {300, 301}
    assert base.token_ids[0] not in banned.outputs[0].token_ids
    # A bad word as text: the tokens it is made of never end the output as a sequence.
    word = default_llm.tokenizer.decode(base.token_ids[:2]).strip()
    out = default_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, bad_words=[word]), use_tqdm=False
    )
    assert word not in out[0].outputs[0].text


def test_logits_processor_runs_per_row(default_llm):
    seen = []

    def only_token_7(output_ids, logits):
        seen.append(list(output_ids))
        logits[:] = float("-inf")
        logits[7] = 0.0
        return logits

    out = default_llm.generate(
        ["x = "],
        SamplingParams(temperature=0, max_tokens=3, logits_processors=[only_token_7]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == [7, 7, 7]
    assert seen == [[], [7], [7, 7]]


def test_bad_control_values(default_llm):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"logit_bias: token id 99999 is outside"):
        default_llm.generate(["x"], SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)


@pytest.mark.gpu
def test_every_output_follows_its_schema_on_cuda():
    """The CUDA path: graphs, async steps and multi-step decode beside constrained rows, the
    bitmask copied from pinned memory and applied by xgrammar's kernel."""
    llm = LLM(str(DEFAULT_MODEL_DIR), max_model_len=1024, max_num_seqs=64)
    schemas = random_object_schemas(seed=46, count=24)
    params = [_params(i, SO(json=s)) for i, s in enumerate(schemas)]
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(["def parse(data):"] * (len(schemas) + 8), params + [free] * 8,
                        use_tqdm=False)
    for schema, out in zip(schemas, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs[len(schemas):])
