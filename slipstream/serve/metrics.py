"""Prometheus metrics for `/metrics`: engine gauges and counters plus front-end latency histograms.

Each server owns its own CollectorRegistry (no global state, so tests can run several apps).
Engine-side numbers come from the stats the engine process publishes; latencies are measured in
the front end, where the client's experience is.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slipstream.outputs import RequestMetrics

PREFIX = "slipstream"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# The parts of a first token's wait (RequestMetrics): fine steps where W6's TTFT lives.
_STAGE_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
                  0.03, 0.035, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0)
_CHUNK_BUCKETS = (1, 2, 3, 4, 6, 8, 16, 32)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)

# (engine stats key, metric suffix, help, kind)
_ENGINE_METRICS = (
    ("num_running", "num_requests_running", "Requests in the running batch.", "gauge"),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
     "gauge"),
    ("num_free_blocks", "kv_cache_free_blocks", "KV cache blocks free for allocation.", "gauge"),
    ("num_total_blocks", "kv_cache_total_blocks", "KV cache blocks in total.", "gauge"),
    ("prefix_cache_queries", "prefix_cache_queries", "Tokens looked up in the prefix cache.",
     "counter"),
    ("prefix_cache_hits", "prefix_cache_hits", "Tokens found in the prefix cache.", "counter"),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks.",
     "counter"),
    ("num_aborted_requests", "engine_aborted_requests",
     "Abort requests the engine received (client gone, stop string matched).", "counter"),
    ("engine_up", "engine_up", "1 while the engine process serves; 0 while it restarts or is "
     "dead.", "gauge"),
    ("engine_restarts", "engine_restarts", "Restarts of a dead or hung engine process.",
     "counter"),
)


class EngineStatsCollector(Collector):
    """Reads the engine's latest published stats at scrape time."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[Any]:
        stats = self._get_stats() or {}
        for key, suffix, help_text, kind in _ENGINE_METRICS:
            value = float(stats.get(key, 0) or 0)
            if kind == "gauge":
                yield GaugeMetricFamily(f"{PREFIX}_{suffix}", help_text, value=value)
            else:
                yield CounterMetricFamily(f"{PREFIX}_{suffix}", help_text, value=value)
        yield from _speculative_metrics(stats.get("speculative") or {})


# Speculative decoding, per method: (stats key, metric suffix, help, kind).
_SPEC_METRICS = (
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
     "counter"),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "counter"),
    ("acceptance_rate", "spec_decode_acceptance_rate", "Accepted over verified draft tokens.",
     "gauge"),
    ("mean_accepted_length", "spec_decode_mean_accepted_length",
     "Tokens emitted per verification (accepted drafts + 1).", "gauge"),
)


def _speculative_metrics(per_method: dict[str, dict[str, float]]) -> Iterator[Any]:
    if not per_method:
        return
    for key, suffix, help_text, kind in _SPEC_METRICS:
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = cls(f"{PREFIX}_{suffix}", help_text, labels=["method"])
        for method, values in per_method.items():
            family.add_metric([method], float(values.get(key, 0) or 0))
        yield family


class ServerMetrics:
    """Implements AsyncLLM's StatLogger; renders the registry for `/metrics`."""

    def __init__(self, model_name: str, get_engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self.registry.register(EngineStatsCollector(get_engine_stats))

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(f"{PREFIX}_{name}", help_text, ["model_name", *extra],
                        registry=self.registry)
            return c if extra else c.labels(**labels)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", help_text, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(**labels)

        self._labels = labels
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished sequences by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                             _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled.", _E2E_BUCKETS)
        # The first token's wait in parts (outputs.RequestMetrics): TTFT = queue + prefill +
        # output delay; the scheduler wait is the part of the queue time inside the engine.
        self.stages = {
            "queue_time": histogram("request_first_schedule_seconds", "Arrival to first "
                                    "scheduled (fine buckets).", _STAGE_BUCKETS),
            "scheduler_wait": histogram("request_scheduler_wait_seconds", "Arrival in the "
                                        "engine to first scheduled.", _STAGE_BUCKETS),
            "prefill_time": histogram("request_prefill_time_seconds", "First scheduled to "
                                      "first token read in the engine.", _STAGE_BUCKETS),
            "output_delay": histogram("request_output_delay_seconds", "First token read in "
                                      "the engine to first token in the front end.",
                                      _STAGE_BUCKETS),
            "num_prefill_chunks": histogram("request_prefill_chunks", "Steps the prompt was "
                                            "computed in before the first token.",
                                            _CHUNK_BUCKETS),
        }

    # StatLogger --------------------------------------------------------------------------

    def on_request_start(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(ttft_s, 0.0))

    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if itl_s is not None:
            for _ in range(num_tokens):
                self.itl.observe(max(itl_s, 0.0))

    def on_request_finished(self, reasons: list[str], e2e_s: float | None,
                            metrics: RequestMetrics | None) -> None:
        for reason in reasons:
            self.request_success.labels(finished_reason=reason, **self._labels).inc()
        if e2e_s is not None:
            self.e2e.observe(max(e2e_s, 0.0))
        if metrics is None:
            return
        if metrics.queue_time is not None:
            self.queue_time.observe(max(metrics.queue_time, 0.0))
        if metrics.first_token_time is None:
            return  # no first token (aborted before one): its parts would mislead
        for name, hist in self.stages.items():
            value = getattr(metrics, name)
            if value is not None:
                hist.observe(max(value, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
