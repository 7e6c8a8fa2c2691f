"""Plain data passed between scheduler and model runner each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.engine.request import Request


@dataclass(slots=True)  # one per running request per step: slots make it cheaper to build
class ScheduledSeq:
    """One request's share of a step: feed `token_ids` at positions start_pos.. ."""

    request: Request
    token_ids: list[int]  # all_token_ids[start_pos : ...], then any draft tokens
    start_pos: int  # == request.num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table (covers start_pos + len(token_ids))
    needs_sample: bool  # this chunk reaches the last known token: sample a new one
    # Multi-step decode: extra tokens the runner feeds back on the device after the first
    # (each sampled token becomes the next input), so num_lookahead + 1 tokens come back.
    num_lookahead: int = 0
    # Speculative decoding: the last num_spec_tokens of token_ids are draft tokens to verify
    # (logits come back for each of them and for the last known token before them).
    num_spec_tokens: int = 0
    # A draft tree: the parent of each draft token (-1: the last known token), breadth-first
    # (speculative/tree.py); None: the drafts are a chain.
    spec_parents: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step (runner may drop per-request state).
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class RunnerOutput:
    """What the model runner returns for one step, keyed by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per generated token: {token_id: logprob} holding the top-N and the sampled token.
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Per prompt position (first is None): {token_id: logprob}; only for requests that asked.
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # Speculative proposers that draft from the target's hidden states (Medusa, EAGLE): the
    # step's speculative.hidden.StepHidden, when the runner was asked to keep them.
    spec_hidden: Any = None
    # Verifications: every row's sampled token (root first, then each draft's row), accepted
    # or not, for proposers that learn from the rows past the first mismatch (lookahead).
    spec_row_token_ids: dict[str, list[int]] = field(default_factory=dict)
