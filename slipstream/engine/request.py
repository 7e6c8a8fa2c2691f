"""Request: one sequence's state as the scheduler sees it (token ids and integers only)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from slipstream.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id, or a stop string (front end aborts with STOP)
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS[self]


_FINISH_REASONS = (None, None, None, "stop", "length", "abort", "error")

# Stands for a token sampled on the device whose id the host has not read (async_scheduling).
PENDING_TOKEN = -1


@dataclass(eq=False)
class Request:
    """A request inside the engine. `priority`: smaller values are served first."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # A pooling request (pooling/): {"dimensions", "normalize"}, and for a text pair
    # "token_type_start" (pooling/pairs.py); its one step returns a vector.
    pooling_params: dict[str, Any] | None = None
    # Beam search (engine/beam.py): the sampler hands this request's top logprobs over as the
    # packed float row of sampling/logprobs.py (no dict), for the search's vectorized step.
    packed_logprobs: bool = False

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # async_scheduling: output tokens sampled on the device but not read yet, held as
    # placeholders (PENDING_TOKEN) at the end of output_token_ids.
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    # Speculative decoding: draft tokens proposed for the next step (never part of the output
    # until verified); the scheduler feeds them after the last known token.
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft tree (speculative/tree.py): the parent of each draft token (-1: the last known
    # token), breadth-first; None: the drafts are a chain.
    spec_parents: list[int] | None = None
    # Sampler state (a torch.Generator for seeded requests); owned by the sampler.
    generator: Any = None
    # Structured output: the request's RequestGrammar (structured/grammar.py), set by the
    # engine once its grammar is compiled; the sampler masks with it, the scheduler advances it.
    grammar: Any = None
    # Timestamps (time.monotonic) for metrics (outputs.RequestMetrics).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    engine_arrival_time: float | None = None
    prefill_chunk_times: list[float] = field(default_factory=list)  # before the first token
    # LoRA (slipstream/lora/): the adapter's id (0: the base model) and directory, and the
    # device slot the scheduler gave it while running (-1: none).
    lora_int_id: int = 0
    lora_path: str | None = None
    lora_slot: int = -1

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (num_tokens less the pending placeholders)."""
        return self.num_tokens - self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
