"""SLIPSTREAM_STEP_TRACE: one JSON line per step, and a summary that accounts for every token."""
from __future__ import annotations

import json

from slipstream import LLM, SamplingParams
from slipstream.engine.step_trace import summarize


def test_trace_lines_and_summary(tiny_llama_dir, tmp_path, monkeypatch):
    ckpt = tiny_llama_dir
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("SLIPSTREAM_STEP_TRACE", str(trace))
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_num_tokens=64, decode_steps=4)
    prompts = [[5 + i] * (20 + 10 * i) for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows, "no trace lines written"
    assert sum(r["prefill_tokens"] for r in rows) == sum(len(p) for p in prompts)
    assert any(r["steps"] == 4 for r in rows), "multi-step decode never traced"
    summary = summarize(rows)
    # Every output token is counted once (no stop strings here, so none is cut).
    assert sum(g["output_tokens"] for g in summary.values()) == 4 * 9
    assert all(g["time_s"] >= 0 for g in summary.values())
