"""async_scheduling: each step is scheduled and launched before the previous step's sampled
tokens are read (they reach it on the device). Same tokens as reading every step first: greedy,
seeded sampling, stops, chunked prefill, waiting requests, preemption, aborts, prefix caching."""
from __future__ import annotations

import argparse
import random

import pytest

from slipstream import LLM, SamplingParams
from slipstream.engine.args import EngineArgs
from slipstream.engine.request import Request
from tests.helpers import finish_after_abort

KV_BLOCK_BYTES = 16 * 2 * 2 * 16 * 4 * 2  # block 16 x (K, V) x 2 KV heads x dim 16 x fp32 x 2 layers


@pytest.mark.parametrize("flags,device,want", [
    ([], "cuda", True), ([], "cpu", False), (["--async-scheduling"], "cpu", True),
    (["--no-async-scheduling"], "cuda", False)])
def test_default_is_on_with_cuda_only(tiny_llama_dir, flags, device, want) -> None:
    """A CPU runs each step as it is launched: leaving it unread would only delay its tokens
    (a batch-1 request's first token would arrive with its last), so the default is CUDA-only."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", str(tiny_llama_dir), "--device", device, *flags])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.scheduler.async_scheduling is want


def _engine(tiny_llama_dir, async_scheduling: bool, device: str = "cpu", **kwargs) -> tuple[LLM, list]:
    """An LLM that counts the steps it leaves unread (launch_sampled)."""
    # A fixed KV budget: tests make two engines in one process (a profiled one gets what's left).
    kwargs = {"max_num_seqs": 6, "max_num_tokens": 64, "max_model_len": 128,
              "kv_cache_memory": 64 << 20, **kwargs}
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, async_scheduling=async_scheduling,
              **kwargs)
    runner, launches = llm.engine.runner, []
    launch = runner.launch_sampled

    def counted(sched, feed=None):
        launches.append(feed is not None)
        return launch(sched, feed)

    runner.launch_sampled = counted
    return llm, launches


def _workload(num: int = 30, seed: int = 0):
    """Greedy (EOS kept or ignored) and seeded sampling, prompts up to 60 tokens (chunked at 64
    tokens a step), more requests than seats."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))] for _ in range(num)]
    params = []
    for i in range(num):
        n = rng.randrange(1, 50)
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=bool(i % 2)))
        else:
            params.append(SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=n))
    return prompts, params


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _assert_clean(llm) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_async_steps_give_the_same_tokens(tiny_llama_dir, decode_steps: int) -> None:
    prompts, params = _workload()
    want = _run(_engine(tiny_llama_dir, False, decode_steps=decode_steps)[0], prompts, params)
    llm, launches = _engine(tiny_llama_dir, True, decode_steps=decode_steps)
    assert _run(llm, prompts, params) == want
    assert {"stop", "length"} <= {reason for _, reason in want}
    assert sum(launches) >= 20  # steps fed from an unread step
    _assert_clean(llm)


def test_async_steps_that_sample_nothing(tiny_llama_dir) -> None:
    """A long prompt alone, chunked 32 tokens a step: its first steps sample no token."""
    prompts = [list(range(3, 103))]
    params = [SamplingParams(temperature=0.7, seed=5, max_tokens=6)]
    want = _run(_engine(tiny_llama_dir, False, max_num_tokens=32, decode_steps=1)[0], prompts, params)
    llm, launches = _engine(tiny_llama_dir, True, max_num_tokens=32, decode_steps=1)
    assert _run(llm, prompts, params) == want
    assert len(launches) >= 8  # 4 chunks, then the decodes
    _assert_clean(llm)


def test_async_steps_under_preemption(tiny_llama_dir) -> None:
    prompts, params = _workload(seed=1)
    small = dict(kv_cache_memory=20 * KV_BLOCK_BYTES, max_num_seqs=8)
    want = _run(_engine(tiny_llama_dir, False, **small)[0], prompts, params)
    llm, launches = _engine(tiny_llama_dir, True, **small)
    # A request preempted while its token is on the device keeps that token (seeded samples
    # would otherwise be drawn again, differently).
    assert _run(llm, prompts, params) == want
    assert llm.get_stats()["num_preemptions"] > 0 and sum(launches) > 0
    _assert_clean(llm)


def test_steps_with_logprobs_or_penalties_are_read_at_once(tiny_llama_dir) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)]
    plain = _engine(tiny_llama_dir, False)[0].generate(prompts, params, use_tqdm=False)
    llm, launches = _engine(tiny_llama_dir, True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert got[0].outputs[0].logprobs == plain[0].outputs[0].logprobs
    assert launches == []


def test_abort_while_a_step_is_unread(tiny_llama_dir) -> None:
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _run(_engine(tiny_llama_dir, False)[0], prompts, [params] * 3)
    llm, _ = _engine(tiny_llama_dir, True, decode_steps=1)
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params, eos_token_ids=(2,)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(4):  # prefill, then decodes: the last one is still unread
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    assert core._inflight is not None
    finish_after_abort(core, tokens, "r1")
    assert tokens["r0"] == want[0][0] and tokens["r2"] == want[2][0]
    _assert_clean(llm)


def test_first_token_is_not_held_by_a_multi_step_decode(tiny_llama_dir) -> None:
    """Offline engines decode 8 steps per read: the step after an unread prefill decodes one
    step, so the first token comes back alone, as soon as the prefill is read (it used to come
    back with the 8 decode tokens after it: W1's TTFT was a prefill plus 8 decode steps)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _run(_engine(tiny_llama_dir, False)[0], [[4, 5, 6]], [params])[0][0]
    llm, _ = _engine(tiny_llama_dir, True, decode_steps=8)
    core = llm.engine
    core.add_request(Request("r", [4, 5, 6], params, eos_token_ids=(2,)))
    per_step = []
    while core.has_unfinished_requests():
        per_step.append([t for out in core.step() for t in out.new_token_ids])
    got = [t for step in per_step for t in step]
    assert got == want
    first = next(i for i, step in enumerate(per_step) if step)
    assert len(per_step[first]) == 1
    assert max(len(step) for step in per_step) > 1  # multi-step decode still runs after it
    _assert_clean(llm)


def test_prefix_cache_hashes_only_read_tokens(tiny_llama_dir) -> None:
    """A follow-up prompt that repeats a finished request's output hits the cached blocks of
    that output exactly as often with async steps (a block hashed while its tokens were still
    placeholders would never match)."""
    first = [list(range(10, 30))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm, _ = _engine(tiny_llama_dir, async_scheduling, max_num_tokens=128, decode_steps=1)
        out = llm.generate(first, params, use_tqdm=False)[0].outputs[0].token_ids
        before = llm.get_stats()["prefix_cache_hits"]
        llm.generate([first[0] + out[:36] + [7]], SamplingParams(max_tokens=1), use_tqdm=False)
        hits.append(llm.get_stats()["prefix_cache_hits"] - before)
    assert hits[0] == hits[1] >= 32  # blocks of 16 within prompt 20 + 36 output tokens


@pytest.mark.gpu
def test_gpu_async_steps_give_the_same_tokens(tiny_llama_dir) -> None:
    prompts, params = _workload(num=40, seed=2)
    for decode_steps in (1, 8):
        want = _run(_engine(tiny_llama_dir, False, device="cuda", decode_steps=decode_steps)[0],
                    prompts, params)
        llm, launches = _engine(tiny_llama_dir, True, device="cuda", decode_steps=decode_steps)
        assert _run(llm, prompts, params) == want
        assert sum(launches) >= 20
        _assert_clean(llm)
