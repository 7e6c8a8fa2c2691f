"""End to end through the real engine on CPU: a tiny dummy-weight Llama, both modes."""
from __future__ import annotations

import json

import pytest

from slipstream.bench.cli import main

try:
    import slipstream.llm  # noqa: F401

    _LLM_ERROR = None
except Exception as exc:  # the engine is being written alongside: say why we skip
    _LLM_ERROR = f"slipstream.llm is not importable yet: {exc!r}"

pytestmark = pytest.mark.skipif(_LLM_ERROR is not None, reason=_LLM_ERROR or "")


def test_throughput_on_the_real_engine(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "thr.json"
    rc = main(["throughput", "--model", str(tiny_model_dir), "--load-format", "dummy",
               "--device", "cpu", "--kv-cache-memory", "4000000", "--num-requests", "6",
               "--input-len", "12",
               "--output-len", "5", "--max-batch-size", "4", "--warmup-requests", "2",
               "--baseline", "hf", "--hf-batch-size", "4", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["total_output_tokens"] == 30 and r["output_len_mismatches"] == 0
    assert r["engine"]["max_batch_size"] == 4 and r["engine"]["load_format"] == "dummy"
    assert r["ttft_ms"]["count"] == 6 and r["ttft_ms"]["median"] > 0
    assert r["e2e_ms"]["p99"] >= r["ttft_ms"]["p99"]
    # TTFT in parts, per request: their means add up to TTFT's.
    parts = r["ttft_parts_ms"]
    assert all(parts[k]["count"] == 6 for k in ("queue_time", "prefill_time", "output_delay"))
    assert sum(parts[k]["mean"] for k in parts) == pytest.approx(r["ttft_ms"]["mean"])
    assert parts["queue_time"]["p99"] > 0  # 6 requests, 4 seats: two wait for a seat
    assert r["steps"]["num_steps"] >= 2 and 1 <= r["steps"]["peak_running"] <= 4
    assert r["kv_cache"]["num_blocks"] and r["kv_cache"]["peak_used_blocks"] >= 4
    assert r["baseline"]["useful_output_tokens"] == 30 and r["ratio_vs_baseline"] > 0
    table = capsys.readouterr().out
    assert "ratio vs baseline" in table and "TTFT part: prefill time" in table


def test_latency_on_the_real_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "lat.json"
    rc = main(["latency", "--model", str(tiny_model_dir), "--load-format", "dummy",
               "--device", "cpu", "--kv-cache-memory", "4000000", "--input-len", "8",
               "--output-len", "6",
               "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["decode_tok_s"]["median"] > 0 and r["ttft_ms"]["count"] == 2
    assert r["sol_pct"] is None and r["engine"]["max_batch_size"] == 1


@pytest.mark.parametrize("mode", ["latency", "throughput"])
def test_speculative_config_compares_with_speculation_off(tiny_model_dir, tmp_path, capsys, mode):
    """The oracle proposer replays the run without speculation: acceptance near its rate."""
    out = tmp_path / f"{mode}.json"
    sizes = (["--batch-size", "2", "--num-iters", "1", "--num-iters-warmup", "0"]
             if mode == "latency" else ["--num-requests", "4", "--warmup-requests", "0"])
    rc = main([mode, "--model", str(tiny_model_dir), "--load-format", "dummy", "--device", "cpu",
               "--kv-cache-memory", "4000000", "--input-len", "8", "--output-len", "24", *sizes,
               "--speculative-config", '{"method": "oracle", "num_speculative_tokens": 3, '
               '"acceptance_rate": 0.9, "adaptive": false}', "--output-json", str(out)])
    assert rc == 0
    spec = json.loads(out.read_text())["speculative"]
    assert spec["config"]["method"] == "oracle" and spec["baseline_tok_s"] > 0
    assert spec["speedup"] > 0 and spec["acceptance_rate"] > 0.5
    assert spec["mean_accepted_length"] > 2
    assert "speed-up" in capsys.readouterr().out
