"""pipeline_decode: the next multi-step decode is queued before the running one's tokens are
read. Same tokens, same finish reasons and the same scheduling decisions as without it."""
from __future__ import annotations

import random

import pytest

from slipstream import LLM, SamplingParams
from tests.helpers import finish_after_abort


def _engine(tiny_llama_dir, pipeline: bool, device: str = "cpu", **kwargs) -> tuple[LLM, list]:
    """An LLM whose runner logs each launch: ("decode", batch, steps) or ("model", batch)."""
    # A fixed KV budget: a test makes two engines in one process (the profiled budget is what
    # the first one left).
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, decode_steps=8, max_model_len=160,
              pipeline_decode=pipeline, kv_cache_memory=64 << 20, **kwargs)
    runner, log = llm.engine.runner, []
    launch, execute = runner.launch_decode_steps, runner.execute_model

    def logged_launch(sched, steps, feed=None):
        log.append(("decode", len(sched.seqs), steps, feed is not None))
        return launch(sched, steps, feed)

    def logged_execute(sched, *rest):
        log.append(("model", len(sched.seqs)))
        return execute(sched, *rest)

    runner.launch_decode_steps, runner.execute_model = logged_launch, logged_execute
    return llm, log


def _workload(seed: int = 0, num: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))] for _ in range(num)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(2, 70), ignore_eos=True)
              for _ in range(num)]
    return prompts, params


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _without_feed(log):
    return [entry[:3] for entry in log]


@pytest.mark.parametrize("max_num_seqs", [4, 16])
def test_pipelined_decode_makes_the_same_steps(tiny_llama_dir, max_num_seqs: int) -> None:
    prompts, params = _workload()  # requests end by length only: known before their tokens
    plain, plain_log = _engine(tiny_llama_dir, False, max_num_seqs=max_num_seqs)
    want = _run(plain, prompts, params)
    piped, log = _engine(tiny_llama_dir, True, max_num_seqs=max_num_seqs)
    assert _run(piped, prompts, params) == want
    # The same batches and step counts in the same order: only when they launch differs.
    assert _without_feed(log) == _without_feed(plain_log)
    assert sum(1 for entry in log if entry[0] == "decode" and entry[3]) >= 3
    stats = piped.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("max_num_seqs", [4, 16])
def test_pipelined_decode_past_a_stop_token(tiny_llama_dir, max_num_seqs: int) -> None:
    prompts, params = _workload()
    plain, _ = _engine(tiny_llama_dir, False, max_num_seqs=max_num_seqs)
    first = _run(plain, prompts, params)
    # Stop tokens the greedy outputs really produce: some requests stop inside a multi-step
    # decode after the next one was queued; its tokens for them must be dropped.
    for i in range(0, len(params), 3):
        tokens = first[i][0]
        if len(tokens) > 12:
            params[i] = SamplingParams(temperature=0, max_tokens=params[i].max_tokens,
                                       stop_token_ids=[tokens[11]], ignore_eos=True)
    want = _run(plain, prompts, params)
    piped, log = _engine(tiny_llama_dir, True, max_num_seqs=max_num_seqs)
    assert _run(piped, prompts, params) == want
    assert any(r == "stop" for _, r in want) and any(r == "length" for _, r in want)
    assert sum(1 for entry in log if entry[0] == "decode" and entry[3]) >= 3
    stats = piped.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not piped.engine.has_unfinished_requests()


def test_no_queued_decode_while_a_waiting_request_could_take_a_free_seat(tiny_llama_dir) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    # The first request ends by length with its first multi-step decode (1 + 8 tokens).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 60, 60)]
    logs = []
    for pipeline in (False, True):
        llm, log = _engine(tiny_llama_dir, pipeline, max_num_seqs=2)
        assert [len(t) for t, _ in _run(llm, prompts, params)] == [9, 60, 60]
        logs.append(_without_feed(log))
    # Then the third request is admitted at once (a mixed step), not after a queued decode
    # of the second alone.
    assert logs[1][:3] == [("model", 2), ("decode", 2, 8), ("model", 2)]
    assert logs[1] == logs[0]


def test_abort_while_a_decode_is_queued(tiny_llama_dir) -> None:
    from slipstream.engine.request import Request

    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = _engine(tiny_llama_dir, False)
    want = _run(plain, prompts, [params] * 3)
    llm, log = _engine(tiny_llama_dir, True)
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params, eos_token_ids=(2,)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while core._queued is None:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    finish_after_abort(core, tokens, "r1")
    assert tokens["r0"] == want[0][0] and tokens["r2"] == want[2][0]
    stats = core.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.gpu
def test_gpu_pipelined_decode_matches_waiting_for_each_step(tiny_llama_dir) -> None:
    prompts, params = _workload(seed=1, num=40)
    plain, plain_log = _engine(tiny_llama_dir, False, device="cuda", max_num_seqs=16)
    want = _run(plain, prompts, params)
    piped, log = _engine(tiny_llama_dir, True, device="cuda", max_num_seqs=16)
    got = _run(piped, prompts, params)
    assert got == want
    assert _without_feed(log) == _without_feed(plain_log)
    assert sum(1 for entry in log if entry[0] == "decode" and entry[3]) >= 3
