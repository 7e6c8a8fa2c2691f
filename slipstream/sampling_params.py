"""SamplingParams: how to pick tokens for one request, validated on construction.

Every bad value raises ValueError naming the field and the allowed range, so the HTTP server
can turn it into a 400 without guessing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Only spellings of the same value are normalised; anything else fails validation.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple) or self.stop is None:
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, tuple) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def validate(self) -> None:
        """Check every field again: a caller may have changed one since construction."""
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def _validate(self) -> None:
        _check_int("n", self.n, 1, 128)
        _check_num("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, 0, None)
        _check_num("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_num("min_p", self.min_p, 0.0, 1.0)
        _check_num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_num("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_list("stop", self.stop, "a string or a list of strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        _check_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")


def _check_list(name: str, value, what: str) -> None:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__} {value!r:.60}")


def _check_int(name: str, value, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high, low_open=False)


def _check_num(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    _check_range(name, value, low, high, low_open)


def _check_range(name, value, low, high, low_open) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")
