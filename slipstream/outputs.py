"""What callers get back: RequestOutput with CompletionOutputs and timing metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic, one clock for the front end and the engine process) of a
    request's way to its first token, and counts. TTFT = queue_time + prefill_time +
    output_delay: arrival in the front end, arrival in the engine, first scheduled, each prompt
    chunk scheduled, first token read in the engine, first token here."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    # Speculative decoding: draft tokens verified for this request and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    engine_arrival_time: float | None = None  # the engine core took the request in
    engine_first_token_time: float | None = None  # the engine read its first token
    # When each chunk of the prompt was scheduled, before the first token (one for a prompt
    # that fits a step's token budget; a preempted request's recompute adds more).
    prefill_chunk_times: list[float] = field(default_factory=list)

    def absorb(self, stamps: dict[str, Any]) -> None:
        """Take the engine's timestamps of a request (EngineCoreOutput.timestamps), once;
        the engine's first_token_time is when it read the token (engine_first_token_time)."""
        for key, name in (("first_scheduled_time", "first_scheduled_time"),
                          ("engine_arrival_time", "engine_arrival_time"),
                          ("first_token_time", "engine_first_token_time")):
            if stamps.get(key) and getattr(self, name) is None:
                setattr(self, name, stamps[key])
        if stamps.get("prefill_chunk_times") and not self.prefill_chunk_times:
            self.prefill_chunk_times = list(stamps["prefill_chunk_times"])

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled (the way to the engine and the wait in its scheduler)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def scheduler_wait(self) -> float | None:
        """Arrival in the engine to first scheduled: the part of queue_time spent waiting for
        a seat or a token budget (the rest is the way there and the step it arrived during)."""
        if self.first_scheduled_time is None or self.engine_arrival_time is None:
            return None
        return self.first_scheduled_time - self.engine_arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token read in the engine: every prompt chunk's step."""
        if self.engine_first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.engine_first_token_time - self.first_scheduled_time

    @property
    def output_delay(self) -> float | None:
        """First token read in the engine to first token here (the way back, detokenizing)."""
        if self.first_token_time is None or self.engine_first_token_time is None:
            return None
        return self.first_token_time - self.engine_first_token_time

    @property
    def num_prefill_chunks(self) -> int:
        return len(self.prefill_chunk_times)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_generated_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class EngineCoreOutput:
    """One request's news from one engine step (plain data: crosses process boundaries)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # RequestMetrics' engine-side times (RequestMetrics.absorb), sent with the first tokens.
    timestamps: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding: draft tokens verified this step and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's embedding or class logits

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
