"""The executor API from many threads: requests complete with the offline engine's tokens,
cancelled ones end "cancelled" at whatever point they were stopped, no KV block is left held,
and shutdown is prompt even with requests running."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from slipstream import LLM, AsyncLLM, EngineArgs, Executor, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_memory=4 << 20, max_model_len=64, max_num_seqs=16, max_num_tokens=256)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(20)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def executor(tiny_llama_dir):
    with Executor(str(tiny_llama_dir), **ENGINE) as ex:
        yield ex


def _run_one(ex: Executor, prompt: list[int], cancel: bool, streaming: bool,
             rng: random.Random) -> tuple[list[int], str | None]:
    rid = ex.enqueue_request(prompt, PARAMS, streaming=streaming)
    if cancel:
        time.sleep(rng.uniform(0, 0.02))
        ex.cancel_request(rid)
    tokens: list[int] = []
    while True:
        for r in ex.await_responses(rid, timeout=60):
            assert r.request_id == rid and r.error is None
            tokens += r.token_ids
            if r.is_final:
                return tokens, r.finish_reason


def test_many_threads_with_cancellations(executor, prompts, expected) -> None:
    results: list[tuple[int, bool, list[int], str | None]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                i, cancel = rng.randrange(len(prompts)), rng.random() < 0.5
                tokens, reason = _run_one(executor, prompts[i], cancel, rng.random() < 0.5, rng)
                with lock:
                    results.append((i, cancel, tokens, reason))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert len(results) == 200
    cancelled = 0
    for i, cancel, tokens, reason in results:
        if reason == "cancelled":
            assert cancel and tokens == expected[i][:len(tokens)]
            cancelled += 1
        else:  # finished, or done before its cancel landed
            assert (reason, tokens) == ("length", expected[i])
    assert cancelled > 20
    stats = executor.get_latest_iteration_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # no block leaked
    assert stats["iteration"] > 0 and stats["step_time_s"] > 0


def test_bad_requests_raise_at_enqueue(executor) -> None:
    with pytest.raises(ValueError):
        executor.enqueue_request([], PARAMS)
    with pytest.raises(ValueError, match="n=2"):
        executor.enqueue_request([5, 6], SamplingParams(n=2))
    with pytest.raises(ValueError, match="unknown"):
        executor.await_responses(10**6, timeout=0)
    assert executor.await_responses(timeout=0) == []  # nothing open: no wait


def test_shutdown_is_prompt_with_requests_running(tiny_llama_dir) -> None:
    ex = Executor(str(tiny_llama_dir), **ENGINE)
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    ids = [ex.enqueue_request([5, 6, 7], long) for _ in range(8)]
    start = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - start < 5
    finals = [r for rid in ids for r in ex.await_responses(rid, timeout=5) if r.is_final]
    assert len(finals) == len(ids)  # each one ends, finished or with an error
    with pytest.raises(RuntimeError, match="shut down"):
        ex.enqueue_request([5, 6], PARAMS)


def test_async_llm_from_engine_args_serves_a_built_engine(tiny_llama_dir, tmp_path,
                                                          expected, prompts) -> None:
    import slipstream

    engine = slipstream.build(str(tiny_llama_dir), tmp_path / "engine", **ENGINE)

    async def run() -> list[int]:
        llm = await AsyncLLM.from_engine_args(EngineArgs(model=str(engine)))
        try:
            assert llm.config.load_format == "engine"
            async for out in llm.generate(prompts[0], PARAMS, "r0"):
                last = out
            return list(last.outputs[0].token_ids)
        finally:
            await llm.shutdown()

    assert asyncio.run(run()) == expected[0]
