"""Multi-step decode on worker ranks (gloo, CPU): one message asks every rank for 8 decode
steps; the tokens equal one process's single steps, stops and max_tokens inside the 8 steps end
a request at the right token, an abort in flight leaves the others' tokens intact, and a rank
killed mid-decode fails the engine.

One pool of two worker processes serves every engine of the module (workers.keep_pools).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from slipstream import LLM, SamplingParams
from slipstream.engine.request import Request
from slipstream.parallel import workers
from tests.helpers import finish_after_abort
from tests.parallel.pools import kept_pool

PROMPTS = [[1, 5, 9, 33, 7, 250, 11], [1, 100, 200, 300, 400, 17, 3, 64, 90]]
ENGINE = dict(device="cpu", kv_cache_memory=8 << 20, max_model_len=128, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
LAYOUTS = {"mp-tp1": dict(distributed_executor_backend="mp"), "tp2": dict(tensor_parallel_size=2)}


@pytest.fixture(scope="module")
def pool():
    yield from kept_pool(2)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def reference(model):
    """One process, a host round trip every token: the oracle's tokens for each case."""
    llm = LLM(model, **ENGINE, decode_steps=1)
    cases = _cases(llm)
    return {name: _generate(llm, params) for name, params in cases.items()}


def _cases(llm) -> dict[str, list[SamplingParams]]:
    """Per case, one SamplingParams per prompt. "stops": prompt 0 stops on its 3rd greedy
    token (stop_token_ids) and prompt 1 ends at max_tokens 5, both inside the first 8 steps."""
    third = _generate(llm, [GREEDY] * 2)[0][2]
    stop = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[third],
                          ignore_eos=True)
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # "stops" first: its decode sent ahead for r0 only is dropped unread once r0 stops, and
    # the next engine step must skip its reply.
    return {"stops": [stop, short], "greedy": [GREEDY] * 2, "seeded": [SEEDED] * 2}


def _generate(llm, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eight_steps_a_message_give_single_step_tokens(pool, model, reference, layout) -> None:
    llm = LLM(model, **ENGINE, decode_steps=8, **LAYOUTS[layout])
    runner = llm.engine.runner
    try:
        assert runner.max_decode_batch >= len(PROMPTS)
        for name, params in _cases(llm).items():
            sent = runner._encoder.num_sent
            assert _generate(llm, params) == reference[name], name
            if name != "stops":  # 1 prefill + 19 decode tokens: 8 + 8 + 3 steps, 4 messages
                assert runner._encoder.num_sent - sent <= 4
    finally:
        llm.engine.shutdown()
    stop_at, short = reference["stops"]
    assert len(stop_at) == 3 and len(short) == 5
    assert stop_at == reference["greedy"][0][:3] and short == reference["greedy"][1][:5]


def test_abort_during_multi_step_decode(pool, model, reference) -> None:
    """r1 is aborted while a multi-step decode of both requests is on the ranks and the next
    one has been sent ahead (pipeline_decode); r0 goes on with the single-step tokens."""
    llm = LLM(model, **ENGINE, decode_steps=8, tensor_parallel_size=2)
    core = llm.engine
    tokens = {"r0": [], "r1": []}
    try:
        for i, p in enumerate(PROMPTS):
            core.add_request(Request(f"r{i}", p, GREEDY))
        while len(tokens["r1"]) < 2 or core._queued is None:
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        finish_after_abort(core, tokens, "r1")
        tail = _generate(llm, [GREEDY] * 2)  # the ranks still answer the right steps
    finally:
        core.shutdown()
    assert tokens["r0"] == reference["greedy"][0]
    assert 2 <= len(tokens["r1"]) < 20 and tokens["r1"] == reference["greedy"][1][:len(tokens["r1"])]
    assert tail == reference["greedy"]


def test_unseeded_sampling_feeds_every_rank_the_same_tokens(pool, model) -> None:
    """seed=None: each rank's generator seeds itself, so without the first rank's tokens
    broadcast the ranks would feed different tokens to the model and the K/V they cache would
    belong to neither. The sampled text, read back through the prefix cache by a greedy
    request, continues as one process continues it from scratch."""
    llm = LLM(model, **ENGINE, decode_steps=8, tensor_parallel_size=2, seed=None)
    try:
        sampled = _generate(llm, [SamplingParams(max_tokens=25, temperature=1.0,
                                                 ignore_eos=True)] * 2)
        texts = [p + s for p, s in zip(PROMPTS, sampled)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": t} for t in texts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert all(o.num_cached_tokens >= 16 for o in outs)
    one = LLM(model, **ENGINE, decode_steps=1, enable_prefix_caching=False)
    want = one.generate([{"prompt_token_ids": t} for t in texts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == \
        [list(o.outputs[0].token_ids) for o in want]


def test_a_rank_killed_during_multi_step_decode_fails_the_engine(pool, model) -> None:
    """Runs last: the pool is lost."""
    llm = LLM(model, **ENGINE, decode_steps=8, tensor_parallel_size=2)
    core = llm.engine
    victim = core.runner.pool.procs[1]
    for i, p in enumerate(PROMPTS):
        core.add_request(Request(f"r{i}", p, GREEDY))
    core.step()  # the prefill
    start = time.monotonic()
    with pytest.raises(workers.WorkerError, match="rank 1"):
        core.step(lambda: os.kill(victim.pid, signal.SIGKILL))  # 8 steps sent, not read
        while core.has_unfinished_requests():
            core.step()
    assert time.monotonic() - start < 10
    for proc in core.runner.pool.procs:
        assert proc.poll() is not None
