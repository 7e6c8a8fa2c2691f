"""Where a served request's first token waits, from a slipstream server's `/metrics`.

The server observes each finished request's RequestMetrics in histograms (serve/metrics.py);
`slipstream bench serve` reads them before and after its timed run and reports the median and
p99 of each part of TTFT over the requests in between. Quantiles come from the histogram's
buckets (linear within a bucket, as Prometheus' histogram_quantile), so they are as fine as the
buckets (1-5 ms steps below 100 ms). A server without these series gives no breakdown.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (metric name, report key, row label, scale to the reported unit)
STAGES = (
    ("slipstream_request_first_schedule_seconds", "queue_ms", "queue (arrival to scheduled)", 1e3),
    ("slipstream_request_scheduler_wait_seconds", "scheduler_wait_ms", "  of which in the scheduler", 1e3),
    ("slipstream_request_prefill_time_seconds", "prefill_ms", "prefill (scheduled to token)", 1e3),
    ("slipstream_request_output_delay_seconds", "output_delay_ms", "engine to front end", 1e3),
    ("slipstream_request_prefill_chunks", "prefill_chunks", "prompt chunks", 1.0),
)

Buckets = dict[str, dict[float, float]]  # metric name -> upper bound -> cumulative count


async def scrape(client: httpx.AsyncClient) -> Buckets | None:
    """The stage histograms' cumulative bucket counts (summed over label sets), or None when
    the server has no `/metrics` or none of these series."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_buckets(resp.text)


def parse_buckets(text: str) -> Buckets | None:
    wanted = {name for name, *_ in STAGES}
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                counts = out.setdefault(family.name, {})
                counts[le] = counts.get(le, 0.0) + sample.value
    return out or None


def histogram_quantile(q: float, cumulative: dict[float, float], discrete: bool = False) -> float | None:
    """The q-quantile of a cumulative histogram (upper bound -> count), interpolated linearly
    inside its bucket (discrete: the bucket's upper bound, for counts); the last finite bound
    when it falls in the +Inf bucket."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            if discrete:
                return bound
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def breakdown(before: Buckets | None, after: Buckets | None) -> dict[str, Any] | None:
    """Median and p99 of each part over the requests that finished between the two scrapes."""
    if after is None:
        return None
    parts: dict[str, Any] = {}
    for name, key, _, scale in STAGES:
        end = after.get(name)
        if end is None:
            continue
        start = (before or {}).get(name, {})
        delta = {le: end[le] - start.get(le, 0.0) for le in end}
        counts = scale == 1.0  # prompt chunks: whole numbers
        p50, p99 = histogram_quantile(0.5, delta, counts), histogram_quantile(0.99, delta, counts)
        parts[key] = {
            "count": int(delta.get(float("inf"), 0)),
            "median": None if p50 is None else p50 * scale,
            "p99": None if p99 is None else p99 * scale,
        }
    return parts or None


def breakdown_rows(parts: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not parts:
        return []
    rows = []
    for _, key, label, scale in STAGES:
        s = parts.get(key)
        if s is None or s["median"] is None:
            continue
        unit = " (ms)" if scale != 1.0 else ""
        rows.append((f"TTFT part: {label} median / p99{unit}", f"{s['median']:.2f} / {s['p99']:.2f}"))
    return rows
