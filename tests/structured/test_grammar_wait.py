"""Grammars compile off the step loop, once per constraint: a request with a new schema waits
outside the scheduler while the batch runs; a compile failure ends only that request; requests
beside constrained ones get the tokens they get alone (async steps and multi-step decode on)."""

from __future__ import annotations

import json
import threading

import pytest

from slipstream import LLM, SamplingParams
from slipstream.engine.request import Request
from slipstream.structured import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    return LLM(
        str(tiny_chat_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_tokens=256,
        async_scheduling=True,
        decode_steps=4,
        grammar_forced_drafts=0,  # drafts make constrained batches synchronous (test_grammar_drafts.py)
    )


def _request(llm, rid: str, params: SamplingParams) -> Request:
    return Request(rid, [0, 7, 9, 11], params, eos_token_ids=(1,))


def test_new_schema_waits_while_the_batch_runs(llm, monkeypatch):
    engine = llm.engine
    manager = engine.grammar_wait.manager
    release = threading.Event()
    compile_once = manager._compile

    def slow_compile(key, params):
        assert release.wait(30)
        return compile_once(key, params)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    so = SO(json={**SCHEMA, "title": "slow"})
    engine.add_request(_request(llm, "free", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    engine.add_request(
        _request(llm, "json", SamplingParams(temperature=0, max_tokens=60, structured_outputs=so))
    )
    tokens: dict[str, list[int]] = {"free": [], "json": []}
    reasons = {}
    for _ in range(20):  # the free request runs to its end while the grammar compiles
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason
        if reasons.get("free"):
            break
    assert reasons["free"] == "length" and len(tokens["free"]) == 6
    assert tokens["json"] == [] and len(engine.grammar_wait) == 1
    assert engine.scheduler.get_request("json") is None
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason
    assert reasons["json"] == "stop"
    text = llm.tokenizer.decode(tokens["json"])
    assert 0 <= json.loads(text)["n"] <= 999
    # Compiled once per distinct constraint: an equal one shares the cached grammar.
    assert manager.compile(SO(json={**SCHEMA, "title": "slow"})) is manager.compile(so)


def test_compile_failure_ends_only_its_request(llm, monkeypatch):
    engine = llm.engine

    def broken(key, params):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(engine.grammar_wait.manager, "_compile", broken)
    engine.add_request(_request(llm, "bad", SamplingParams(structured_outputs=SO(regex="x+"), max_tokens=5)))
    engine.add_request(_request(llm, "ok", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    reasons = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert reasons == {"bad": "error", "ok": "length"}


def test_neighbours_of_constrained_requests_are_unaffected(llm):
    prompts = ["hello world", "the quick brown fox", "def main():"]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constrained = SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=SCHEMA))
    outs = llm.generate(prompts + prompts, [free] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    for o in outs[3:]:
        assert o.outputs[0].finish_reason == "stop"
        assert json.loads(o.outputs[0].text)["n"] <= 999
