"""Constrained requests in async steps: the forward of step N + 1 is launched before the tokens
of step N are read, the grammars advance and the bitmask is filled while it runs. The outputs
are exactly those of plain synchronous steps, greedy and seeded, with grammars ending at
different steps beside requests that go on, unconstrained neighbours and n > 1."""

from __future__ import annotations

import json

import jsonschema
import pytest

from slipstream import LLM, SamplingParams
from slipstream.structured import StructuredOutputsParams as SO
from tests.structured.schemas import random_object_schemas


def _llm(path, overlap: bool) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_tokens=256,
        max_num_seqs=16,
        async_scheduling=overlap,
        decode_steps=1,
    )


@pytest.fixture(scope="module")
def outputs(tiny_chat_model_dir):
    schemas = random_object_schemas(seed=7, count=6)
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, seed=i)
        prompts.append(f"record {i}:")
        params.append(
            SamplingParams(
                max_tokens=200, structured_outputs=SO(json=schema), n=2 if i == 2 else 1, **sampling
            )
        )
    prompts += ["a b c", "yes or no"]
    params += [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            max_tokens=20, structured_outputs=SO(choice=["yes", "no", "maybe"]), temperature=1.0, seed=3
        ),
    ]
    got = {}
    for overlap in (False, True):
        llm = _llm(tiny_chat_model_dir, overlap)
        got[overlap] = llm.generate(prompts, params, use_tqdm=False)
    return schemas, got


def test_overlapped_steps_give_the_same_tokens(outputs):
    _, got = outputs
    plain = [[c.token_ids for c in o.outputs] for o in got[False]]
    overlapped = [[c.token_ids for c in o.outputs] for o in got[True]]
    assert overlapped == plain
    reasons = [[c.finish_reason for c in o.outputs] for o in got[True]]
    assert reasons == [[c.finish_reason for c in o.outputs] for o in got[False]]
    # Grammars end at different steps, so later steps sample rows of finished requests.
    lengths = {len(c.token_ids) for o in got[True][:6] for c in o.outputs}
    assert len(lengths) > 2


def test_overlapped_outputs_follow_their_constraints(outputs):
    schemas, got = outputs
    for out, schema in zip(got[True], schemas):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
    assert got[True][-1].outputs[0].text in ("yes", "no", "maybe")
