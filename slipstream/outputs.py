"""What callers get back: RequestOutput with CompletionOutputs and timing metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    # Speculative decoding: draft tokens verified for this request and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

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


@dataclass
class EngineCoreOutput:
    """One request's news from one engine step (plain data: crosses process boundaries)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    timestamps: dict[str, float] = field(default_factory=dict)
    # Speculative decoding: draft tokens verified this step and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's embedding or class logits

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
