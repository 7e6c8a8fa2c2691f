"""Reports: every BENCHMARKS.md field in the JSON, the table printed last, statistics right.

The engine is replaced by FakeLLM (conftest) so these check the bench's own arithmetic.
"""
from __future__ import annotations

import json

import pytest

from slipstream.bench import report
from slipstream.bench.cli import main


def _last_block(text: str) -> str:
    return text[text.rindex("== slipstream bench"):]


def test_summarize_mean_median_p99_in_ms():
    s = report.summarize([0.001 * i for i in range(1, 101)] + [None])
    assert s["count"] == 100
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)
    assert report.summarize([None])["mean"] is None


def test_throughput_json_has_every_field(fake_llm, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "res" / "w.json"
    rc = main(["throughput", "--model", str(tiny_model_dir), "--load-format", "dummy",
               "--num-requests", "6", "--input-len", "10", "--output-len", "5", "--label", "W2",
               "--baseline", "hf", "--hf-batch-size", "4", "--hf-num-requests", "4",
               "--max-batch-size", "3", "--max-num-tokens", "64", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in report.THROUGHPUT_FIELDS:
        assert key in r, key
    for key in report.ENGINE_FIELDS:
        assert r["engine"][key] is not None, key
    for key in report.META_FIELDS:
        assert key in r["meta"], key
    assert r["workload"] == "W2" and r["num_requests"] == 6
    assert r["engine"]["max_batch_size"] == 3 and r["engine"]["max_num_tokens"] == 64
    assert r["engine"]["max_model_len"] == 15  # the longest request, when not given
    assert r["engine"]["cuda_graphs"] is False  # cpu
    assert r["total_input_tokens"] == 60 and r["total_output_tokens"] == 30
    assert r["output_len_mismatches"] == 0
    assert r["output_tok_s"] == pytest.approx(30 / r["wall_time_s"])
    assert r["total_tok_s"] == pytest.approx(90 / r["wall_time_s"])
    assert r["ttft_ms"]["median"] == pytest.approx(10.0, rel=1e-3)  # FakeLLM: 10 ms
    assert r["tpot_ms"]["mean"] == pytest.approx(0.1, rel=1e-3)
    assert r["kv_cache"]["num_blocks"] == 1000 and r["kv_cache"]["utilization"] == 0.25
    assert r["kv_cache"]["blocks_for_full_batch"] == 3  # 3 requests x 1 block of 16
    base = r["baseline"]
    assert base["name"] == "hf" and base["num_requests"] == 4 and base["batch_size"] == 4
    assert r["ratio_vs_baseline"] == pytest.approx(r["output_tok_s"] / base["output_tok_s"])
    # warm-up ran with other prompts than the timed run (no prefix-cache help)
    warm, timed = fake_llm[0].calls
    assert not set(map(tuple, warm)) & set(map(tuple, timed))
    table = _last_block(capsys.readouterr().out)
    assert "ratio vs baseline" in table and table.rstrip().endswith("-" * 10)


def test_w5_run_passes_one_sampling_params_per_request(fake_llm, tiny_model_dir, tmp_path):
    out = tmp_path / "w5.json"
    main(["throughput", "--model", str(tiny_model_dir), "--dataset", "w5", "--num-requests",
          "20", "--warmup-requests", "0", "--load-format", "dummy", "--output-json", str(out)])
    r = json.loads(out.read_text())
    from slipstream.bench.datasets import w5_lengths

    lengths = w5_lengths(20)
    assert r["total_output_tokens"] == sum(o for _, o in lengths)
    assert r["total_input_tokens"] == sum(i for i, _ in lengths)
    assert r["engine"]["max_model_len"] == max(i + o for i, o in lengths)
    assert r["input_len"] == "mixed" and len(fake_llm[0].calls) == 1


def test_latency_json_and_cpu_skips_bandwidth(fake_llm, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["latency", "--model", str(tiny_model_dir), "--load-format", "dummy",
               "--batch-size", "2", "--input-len", "8", "--output-len", "11",
               "--num-iters", "3", "--num-iters-warmup", "1", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in report.LATENCY_FIELDS:
        assert key in r, key
    assert r["engine"]["max_batch_size"] == 2  # follows --batch-size
    assert len(fake_llm[0].calls) == 4
    assert all(len(c) == 2 and len(c[0]) == 8 for c in fake_llm[0].calls)
    assert len({tuple(c[0]) for c in fake_llm[0].calls}) == 4  # fresh prompts every iteration
    # FakeLLM: 10 decode tokens in 1 ms per request, both requests side by side
    assert r["decode_tok_s"]["median"] == pytest.approx(2 * 10 / 1e-3, rel=1e-3)
    assert r["ttft_ms"]["count"] == 3
    assert r["copy_bandwidth_gbps"] is None and r["sol_pct"] is None
    assert r["sol_detail"]["weight_bytes"] > 0
    assert "% of speed of light" in _last_block(capsys.readouterr().out)


def test_speed_of_light_arithmetic():
    from slipstream.bench.latency import speed_of_light
    from slipstream.bench.shapes import shape_config

    sol = speed_of_light(shape_config("llama-3.1-8b"), "bfloat16", 4.14e12, 1, 128, 257)
    assert sol["bound_tok_s"] == pytest.approx(257.78, rel=1e-3)
    kv = (128 + 128) * 131072
    assert sol["kv_bytes_per_step"] == kv
    assert sol["bound_with_kv_tok_s"] == pytest.approx(4.14e12 / (16_060_522_496 + kv))
    assert speed_of_light(shape_config("llama-3.1-8b"), "bfloat16", None, 1, 1, 2)[
        "bound_tok_s"] is None


def test_summary_over_a_results_dir(fake_llm, tiny_model_dir, tmp_path, capsys):
    for name in ("a", "b"):
        main(["throughput", "--model", str(tiny_model_dir), "--num-requests", "2",
              "--input-len", "4", "--output-len", "3", "--label", f"W-{name}",
              "--load-format", "dummy", "--output-json", str(tmp_path / f"{name}.json")])
    (tmp_path / "broken.json").write_text("{}")
    capsys.readouterr()
    assert report.print_summary(tmp_path) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("== slipstream GPU suite summary")
    assert lines[2].startswith("W-a") and lines[3].startswith("W-b")
    assert "unreadable" in lines[4]
