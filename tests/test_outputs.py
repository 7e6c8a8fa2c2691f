"""RequestMetrics (outputs.py): the engine's timestamps on the way to the first token, carried
to the caller, and TTFT in parts that add up to it (the scheduler's stamps: tests/scheduler)."""

from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams
from slipstream.outputs import RequestMetrics


def test_metrics_take_the_engine_stamps_once():
    m = RequestMetrics(arrival_time=1.0)
    m.absorb(
        {
            "first_scheduled_time": 1.5,
            "engine_arrival_time": 1.2,
            "first_token_time": 1.9,
            "prefill_chunk_times": [1.5, 1.7],
        }
    )
    m.absorb({"first_scheduled_time": 9.0, "prefill_chunk_times": [9.0]})  # later: ignored
    m.first_token_time = 2.0
    assert (m.queue_time, m.scheduler_wait, m.prefill_time, m.output_delay) == pytest.approx(
        (0.5, 0.3, 0.4, 0.1)
    )
    assert m.num_prefill_chunks == 2
    assert m.queue_time + m.prefill_time + m.output_delay == pytest.approx(m.time_to_first_token)


def test_offline_outputs_carry_the_breakdown(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_tokens=8, kv_cache_memory=8 << 20)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    short, long = llm.generate([[1, 2, 3], list(range(1, 21))], params)
    # 8 tokens a step: the short prompt's 3 leave 5 for the long one, then its decodes take
    # one a step: 5 + 7 + 7 + 1.
    for out, chunks in ((short, 1), (long, 4)):
        m = out.metrics
        assert m.num_prefill_chunks == chunks
        assert m.arrival_time <= m.engine_arrival_time <= m.first_scheduled_time
        assert m.first_scheduled_time == m.prefill_chunk_times[0]
        assert m.prefill_chunk_times[-1] <= m.engine_first_token_time <= m.first_token_time
        ttft = m.queue_time + m.prefill_time + m.output_delay
        assert ttft == pytest.approx(m.time_to_first_token)
