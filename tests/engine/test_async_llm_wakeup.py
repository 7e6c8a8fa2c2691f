"""An idle engine process starts on a request as soon as AsyncLLM.generate() returns, not when
the front end's event loop next gets round to a send task: on a busy server the handler that
called generate() goes on building its response first, and that time used to add to TTFT."""

from __future__ import annotations

import asyncio
import time

from slipstream import AsyncLLM, EngineArgs, SamplingParams

ENGINE = dict(kv_cache_memory=4 << 20, max_model_len=64, max_num_seqs=4, max_num_tokens=64)
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
BUSY_S = 1.0  # how long the event loop stays busy after generate() returns


async def _final(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_idle_engine_takes_a_request_while_the_caller_still_runs(tiny_llama_dir) -> None:
    async def run() -> tuple[float, float, list[int], list[int]]:
        config = EngineArgs(model=str(tiny_llama_dir), **ENGINE).create_engine_config()
        llm = await AsyncLLM.create(config)
        try:
            warm = await _final(llm.generate([5, 6, 7, 8], PARAMS, "warm"))
            await asyncio.sleep(0.2)  # the engine is idle again, blocked on its inbox
            stream = llm.generate([5, 6, 7, 8], PARAMS, "r1")
            returned = time.monotonic()
            time.sleep(BUSY_S)  # the handler goes on without yielding to the event loop
            out = await _final(stream)
            return (
                returned,
                out.metrics.engine_arrival_time,
                list(warm.outputs[0].token_ids),
                list(out.outputs[0].token_ids),
            )
        finally:
            await llm.shutdown()

    returned, engine_arrival, warm_ids, ids = asyncio.run(run())
    assert ids == warm_ids and len(ids) == 3  # the same greedy tokens both times
    # A send deferred to the event loop reaches the engine only after BUSY_S; half of it is
    # room for a loaded machine to wake the engine process.
    assert engine_arrival - returned < BUSY_S / 2, engine_arrival - returned
