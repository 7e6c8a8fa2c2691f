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


def _run(path, overlap: bool, device: str = "cpu"):
    """(outputs, how many steps sampled after their forward was launched: _launch_async's
    constrained path) of one engine over the workload below."""
    # A fixed KV budget: two engines in one process (a profiled one would get what's left).
    llm = LLM(
        str(path),
        dtype="float32",
        device=device,
        max_model_len=256,
        max_num_tokens=256,
        max_num_seqs=16,
        async_scheduling=overlap,
        decode_steps=1,
        kv_cache_memory=64 << 20,
        grammar_forced_drafts=0,  # drafts make constrained steps synchronous (test_grammar_drafts.py)
    )
    runner, split = llm.engine.runner, []
    launch_logits = runner.launch_logits

    def counted(sched, feed=None):
        split.append(feed is not None)
        return launch_logits(sched, feed)

    runner.launch_logits = counted
    prompts, params = _workload()
    try:
        return llm.generate(prompts, params, use_tqdm=False), sum(split)
    finally:
        llm.engine.shutdown()


def _workload():
    """JSON schemas greedy and seeded (one with n=2), a choice, an unconstrained neighbour."""
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
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
    return prompts, params


SCHEMAS = random_object_schemas(seed=7, count=6)


@pytest.fixture(scope="module")
def outputs(tiny_chat_model_dir):
    return {overlap: _run(tiny_chat_model_dir, overlap) for overlap in (False, True)}


def _tokens(outs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_overlapped_steps_give_the_same_tokens(outputs):
    (plain, none_split), (overlapped, split) = outputs[False], outputs[True]
    assert none_split == 0 and split >= 20  # the overlapped path ran, fed by the step before
    assert _tokens(overlapped) == _tokens(plain)
    # Grammars end at different steps, so later steps sample rows of finished requests.
    assert len({len(c.token_ids) for o in overlapped[:6] for c in o.outputs}) > 2


@pytest.mark.gpu
def test_overlapped_steps_give_the_same_tokens_on_cuda(tiny_chat_model_dir):
    """Pinned buffers, the copy and xgrammar's kernel queued behind a replayed graph."""
    plain, _ = _run(tiny_chat_model_dir, False, device="cuda")
    overlapped, split = _run(tiny_chat_model_dir, True, device="cuda")
    assert split >= 20
    assert _tokens(overlapped) == _tokens(plain)


def test_overlapped_outputs_follow_their_constraints(outputs):
    overlapped, _ = outputs[True]
    for out, schema in zip(overlapped, SCHEMAS):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
    assert overlapped[-1].outputs[0].text in ("yes", "no", "maybe")


def test_scheduler_advances_grammars_together():
    """One batched accept per step: a grammar's end stops its request even with ignore_eos; a
    token the grammar rejects ends only its request; the others go on."""
    from slipstream.assets import DEFAULT_MODEL_DIR
    from slipstream.config import CacheConfig, SchedulerConfig
    from slipstream.engine.request import Request
    from slipstream.scheduler.output import RunnerOutput
    from slipstream.scheduler.scheduler import Scheduler
    from slipstream.structured.grammar import RequestGrammar
    from slipstream.structured.manager import StructuredOutputManager
    from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

    tokenizer = maybe_load_tokenizer(str(DEFAULT_MODEL_DIR))
    compiled = StructuredOutputManager(str(DEFAULT_MODEL_DIR), 4096).compile(SO(choice=["ab"])).result()
    eos = tuple(tokenizer.eos_token_ids)
    ab = tokenizer.encode("ab", add_special_tokens=False)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=32),
    )
    requests = {}
    for rid in ("ends", "bad", "free"):
        params = SamplingParams(
            max_tokens=10, ignore_eos=True, structured_outputs=SO(choice=["ab"]) if rid != "free" else None
        )
        req = Request(rid, [5, 6, 7], params, eos_token_ids=eos)
        if rid != "free":
            req.grammar = RequestGrammar(compiled, eos)
        sched.add_request(req)
        requests[rid] = req
    bad = next(t for t in range(100, 4096) if not tokenizer.decode([t]).startswith("a"))
    script = {"ends": [*ab, eos[0]], "bad": [bad], "free": [9] * (len(ab) + 1)}
    reasons = {}
    for i in range(len(ab) + 1):
        out = sched.schedule()
        ro = RunnerOutput()
        for seq in out.seqs:
            ro.sampled_token_ids[seq.request_id] = [script[seq.request_id][i]]
        for o in sched.update_from_output(out, ro):
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    assert reasons == {"ends": "stop", "bad": "stop"}
    assert requests["ends"].output_token_ids == [*ab, eos[0]]
    assert requests["bad"].output_token_ids == [bad]  # emitted, then the request ended
    assert requests["free"].status.name == "RUNNING"
    assert len(requests["free"].output_token_ids) == len(ab) + 1
