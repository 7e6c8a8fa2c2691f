"""SamplingParams: how to pick tokens for one request, validated on construction.

Every bad value raises ValueError naming the field and the allowed range, so the HTTP server
can turn it into a 400 without guessing.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.structured.params import StructuredOutputsParams, coerce

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


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
    # Logit controls (sampling/logit_controls.py) and constrained decoding (structured/).
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (the front end tokenizes them)
    bad_words_token_ids: list[list[int]] | None = None  # bad_words as token ids
    # fn(output_token_ids, logits [V]) -> logits [V]; offline API only (callables cannot
    # cross to the server's engine process).
    logits_processors: list[Callable[[list[int], Any], Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.structured_outputs = coerce(self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {_bias_key(k): v for k, v in self.logit_bias.items()}
        self._validate()
        if self.structured_outputs is not None:
            self.structured_outputs.check()

    @property
    def has_logit_controls(self) -> bool:
        """Any of logit_bias, allowed_token_ids, bad words or logits_processors."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.logits_processors)

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
        self._validate_logit_controls()

    def _validate_logit_controls(self) -> None:
        for token, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token, 0, None)
            _check_num("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, 0, None)
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word:
                raise ValueError("bad_words: every bad word must be a non-empty string")
        for ids in self.bad_words_token_ids or ():
            if not ids:
                raise ValueError("bad_words_token_ids: every entry must be a non-empty list")
            for t in ids:
                _check_int("bad_words_token_ids", t, 0, None)
        for fn in self.logits_processors or ():
            if not callable(fn):
                raise ValueError(f"logits_processors: {fn!r} is not callable")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                             "grammar decides where the output ends")


def _bias_key(key) -> int:
    """OpenAI sends logit_bias keys as strings of token ids."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
    return key


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
