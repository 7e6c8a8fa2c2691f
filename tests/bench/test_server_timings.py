"""bench/server_timings.py: quantiles from a server's /metrics histograms, counted between two
scrapes (the end-to-end run against a server: tests/bench/test_serve.py)."""

from __future__ import annotations

import pytest

from slipstream.bench.server_timings import breakdown, histogram_quantile, parse_buckets


def test_histogram_quantiles_interpolate_inside_a_bucket():
    # 10 observations: 4 at or below 0.01, 5 more at or below 0.02, 1 at or below 0.04.
    cum = {0.01: 4.0, 0.02: 9.0, 0.04: 10.0, float("inf"): 10.0}
    assert histogram_quantile(0.5, cum) == pytest.approx(0.012)  # rank 5: 1/5 into (0.01, 0.02]
    assert histogram_quantile(0.99, cum) == pytest.approx(0.038)  # rank 9.9: 0.9 into (0.02, 0.04]
    assert histogram_quantile(0.5, cum, discrete=True) == 0.02  # counts: the bucket's bound
    assert histogram_quantile(0.5, {0.01: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {0.01: 1.0, float("inf"): 3.0}) == 0.01  # in +Inf: the last bound


def test_breakdown_counts_only_requests_between_the_scrapes():
    def text(fast: int, slow: int) -> str:
        name = "slipstream_request_prefill_time_seconds"
        return (
            f"# TYPE {name} histogram\n"
            f'{name}_bucket{{le="0.01",model_name="m"}} {fast}\n'
            f'{name}_bucket{{le="0.1",model_name="m"}} {fast + slow}\n'
            f'{name}_bucket{{le="+Inf",model_name="m"}} {fast + slow}\n'
            f'{name}_count{{model_name="m"}} {fast + slow}\n'
            f'{name}_sum{{model_name="m"}} 1.0\n'
        )

    parts = breakdown(parse_buckets(text(50, 0)), parse_buckets(text(50, 2)))
    assert parts["prefill_ms"]["count"] == 2  # the 50 before are not counted
    assert parts["prefill_ms"]["median"] == pytest.approx(55.0)  # halfway into (10, 100] ms
    assert parse_buckets("# TYPE other counter\nother_total 1\n") is None
