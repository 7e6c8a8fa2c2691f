"""`slipstream bench serve` against the test server: counts, latency stats, goodput, JSON."""
from __future__ import annotations

import json

import pytest

from slipstream.bench.serve import arrival_gaps, main, parse_goodput
from tests.serve.server import API_KEY


@pytest.mark.parametrize("mode", [["--max-concurrency", "4"], ["--request-rate", "50"]])
def test_bench_serve_end_to_end(server, tmp_path, capsys, mode):
    out = tmp_path / "serve.json"
    code = main(["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "10",
                 "--input-len", "6", "--output-len", "16", "--goodput", "ttft:60000",
                 "tpot:60000", "--output-json", str(out), *mode])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 10 and result["failed"] == 0
    # ignore_eos: exactly output_len each. 16 tokens, not fewer: the stream may coalesce tokens
    # that arrive together (a loaded machine), and ITL needs at least two chunks per request.
    assert result["total_output_tokens"] == 10 * 16
    assert result["total_input_tokens"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = result[key]
        assert stats["count"] > 0 and 0 < stats["median"] <= stats["p99"], (key, stats)
    assert result["ttft_ms"]["median"] <= result["e2e_ms"]["median"]
    assert result["goodput"]["req_s"] == pytest.approx(result["request_throughput"])
    table = capsys.readouterr().out
    assert "TTFT mean / median / p99 (ms)" in table and "goodput" in table
    # The server's view of each TTFT part, over exactly the 10 timed requests.
    parts = result["ttft_parts"]
    for key in ("queue_ms", "scheduler_wait_ms", "prefill_ms", "output_delay_ms", "prefill_chunks"):
        assert parts[key]["count"] == 10 and 0 <= parts[key]["median"] <= parts[key]["p99"], key
    assert parts["prefill_chunks"]["p99"] == 1  # a 6-word prompt: one chunk each
    assert "TTFT part: prefill (scheduled to token) median / p99 (ms)" in table


def test_bench_serve_goodput_counts_only_requests_within_slo(server, tmp_path):
    out = tmp_path / "strict.json"
    main(["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "4",
          "--input-len", "4", "--output-len", "3", "--goodput", "ttft:0.0001",
          "--output-json", str(out)])
    assert json.loads(out.read_text())["goodput"]["req_s"] == 0.0


def test_poisson_gaps_have_the_requested_mean():
    gaps = arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 0.05) < 0.005
    assert arrival_gaps(3, rate=float("inf"), burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]


def test_goodput_flag_parsing():
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
