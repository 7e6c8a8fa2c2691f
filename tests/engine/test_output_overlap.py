"""The offline loop processes each step's outputs while the next step's GPU work runs: the
engine calls that work once per step, after queueing the step and before waiting for it, and
nothing changes in what generate() returns (tokens, text, stop strings, freed blocks). A CPU
engine processes them right after each step instead; these tests turn the overlap on to run
it on the CPU."""
from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(default_model_path()), device="cpu", max_num_seqs=4)
    llm._overlap_outputs = True  # as on a GPU
    return llm


def _events(llm) -> list[str]:
    """The order of forwards and output processing in a generate() of two 5-token requests."""
    events = []
    runner, graphs = llm.engine.runner, llm.engine.runner._graphs
    forward, steps, process = runner._forward_inputs, graphs.run_steps, llm._outputs.process
    # The prefill runs a forward; the greedy decodes run several steps in one call (run_steps).
    runner._forward_inputs = lambda *a: events.append("forward") or forward(*a)
    graphs.run_steps = lambda *a: events.append("forward") or steps(*a)
    llm._outputs.process = lambda *a, **k: events.append("process") or process(*a, **k)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([[5, 6, 7, 8]] * 2, params, use_tqdm=False)
    finally:
        del runner._forward_inputs, graphs.run_steps, llm._outputs.process
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    return events


def test_outputs_are_processed_during_the_next_step(llm):
    events = _events(llm)
    # Step 1's outputs wait for step 2's forward; the last ones are processed after the loop.
    assert events[:3] == ["forward", "forward", "process"]
    assert events[-1] == "process" and events.count("process") == events.count("forward")


def test_a_cpu_engine_processes_each_step_right_after_it(llm):
    llm._overlap_outputs = False  # a CPU engine's default
    try:
        events = _events(llm)
    finally:
        llm._overlap_outputs = True
    assert events == ["forward", "process"] * (len(events) // 2)


def test_engine_calls_the_overlap_work_once_per_step(llm):
    calls = []
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.step(while_gpu_runs=lambda: calls.append(1)) == []  # empty step
    assert calls == [1]


def test_stop_strings_and_blocks_with_overlap(llm):
    prompt = "def fibonacci(n):"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    stop = full[12:15]
    assert stop and full.index(stop) >= 1
    out = llm.generate([prompt, prompt], params.clone(stop=[stop]), use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (full[:full.index(stop)], "stop", stop)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not llm.engine.has_unfinished_requests()


def test_an_output_processing_error_surfaces_after_the_step_and_leaves_the_engine_clean(llm):
    process = llm._outputs.process
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # runs inside the third engine step
            raise RuntimeError("detokenizer exploded")
        return process(*a, **k)

    llm._outputs.process = failing
    try:
        with pytest.raises(RuntimeError, match="detokenizer exploded"):
            llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True), use_tqdm=False)
    finally:
        del llm._outputs.process
    assert not llm.engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 3
