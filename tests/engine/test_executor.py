"""The executor API from many threads: requests complete with the offline engine's tokens,
cancelled ones end "cancelled" at whatever point they were stopped, no KV block is left held,
and shutdown is prompt even with requests running. n > 1 sequences and a LoRA adapter give the
offline engine's tokens too."""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest

from slipstream import LLM, AsyncLLM, EngineArgs, Executor, LoRARequest, SamplingParams
from tests.lora.peft_adapters import make_adapter

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_memory=4 << 20, max_model_len=64, max_num_seqs=16, max_num_tokens=256)
# the shared executor and its offline twin also serve an adapter
WITH_LORA = dict(ENGINE, enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(20)]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), **WITH_LORA)


@pytest.fixture(scope="module")
def expected(offline, prompts) -> list[list[int]]:
    outs = offline.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def executor(tiny_llama_dir):
    with Executor(str(tiny_llama_dir), **WITH_LORA) as ex:
        yield ex


def _collect(ex: Executor, rid: int, n: int) -> dict[int, tuple[list[int], list, str | None]]:
    """Each sequence's tokens, logprobs and finish reason, once all n have ended."""
    seqs: dict[int, tuple[list[int], list, list[str | None]]] = {}
    finals = 0
    while finals < n:
        for r in ex.await_responses(rid, timeout=60):
            assert r.request_id == rid and r.error is None
            tokens, lps, reason = seqs.setdefault(r.index, ([], [], [None]))
            assert reason == [None]  # nothing after a sequence's final response
            tokens += r.token_ids
            lps += r.logprobs or []
            if r.is_final:
                reason[0] = r.finish_reason
                finals += 1
    return {i: (t, lp, reason[0]) for i, (t, lp, reason) in seqs.items()}


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
    with pytest.raises(ValueError, match="n"):
        executor.enqueue_request([5, 6], SamplingParams(n=1).clone(n=0))
    with pytest.raises(ValueError, match="LoRARequest"):
        executor.enqueue_request([5, 6], PARAMS, lora_request="adapter")
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


def test_n_sequences_equal_the_offline_engine(executor, offline, prompts) -> None:
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True,
                            logprobs=1)
    want = offline.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    want_ids = [list(c.token_ids) for c in want.outputs]
    assert want_ids[0] != want_ids[1]  # two real samples, not one twice
    for streaming in (False, True):
        rid = executor.enqueue_request(prompts[1], params, streaming=streaming)
        got = _collect(executor, rid, 2)
        assert [got[i][0] for i in (0, 1)] == want_ids
        assert [got[i][2] for i in (0, 1)] == ["length", "length"]
        assert [len(got[i][1]) for i in (0, 1)] == [5, 5]  # a logprob entry per token
        with pytest.raises(ValueError, match="unknown"):  # closed once both ended
            executor.await_responses(rid, timeout=0)
    rid = executor.enqueue_request(prompts[1], params.clone(max_tokens=50), streaming=True)
    executor.cancel_request(rid)
    assert {i: reason for i, (_, _, reason) in _collect(executor, rid, 2).items()} \
        == {0: "cancelled", 1: "cancelled"}


def test_lora_request_reaches_the_engine(executor, offline, tiny_llama_dir, tmp_path,
                                         prompts) -> None:
    lora = LoRARequest("a", 1, str(make_adapter(tiny_llama_dir, tmp_path / "a", ["q_proj"], 4)))
    want = offline.generate([{"prompt_token_ids": prompts[2]}], PARAMS, use_tqdm=False,
                            lora_request=lora)[0].outputs[0].token_ids
    base = offline.generate([{"prompt_token_ids": prompts[2]}], PARAMS,
                            use_tqdm=False)[0].outputs[0].token_ids
    assert list(want) != list(base)  # the adapter changes the output
    rid = executor.enqueue_request(prompts[2], PARAMS, lora_request=lora)
    assert _collect(executor, rid, 1)[0][0] == list(want)


def test_async_beam_search_stream_settles_and_aborts_cleanly(executor, offline) -> None:
    """AsyncLLM.beam_search_stream: the settled tokens start every returned hypothesis and the
    result equals the offline search; leaving the stream early aborts the search, freeing
    every block."""
    from slipstream import BeamSearchParams

    prompt = [5, 17, 99, 250, 8, 41, 3]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    (want,) = offline.beam_search([prompt], params)
    llm = executor._llm

    async def read_all():
        settled, result = [], None
        async for update in llm.beam_search_stream(prompt, params, "beams-all"):
            assert result is None  # the result comes last
            settled += update.settled_token_ids
            result = update.output
        return settled, result

    async def leave_early():
        long = BeamSearchParams(beam_width=3, max_tokens=48, ignore_eos=True)
        stream = llm.beam_search_stream(prompt, long, "beams-left")
        async with contextlib.aclosing(stream):
            first = await anext(stream)
        for _ in range(100):
            stats = await llm.get_stats(fresh=True)
            if stats["num_running"] == stats["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        return first, stats

    settled, result = executor._call(read_all())
    assert [s.output_token_ids for s in result.sequences] == [s.output_token_ids for s in want.sequences]
    assert settled and all(s.output_token_ids[: len(settled)] == settled for s in result.sequences)
    first, stats = executor._call(leave_early())
    assert first.output is None and first.settled_token_ids  # left mid-search
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
