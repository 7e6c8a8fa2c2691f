"""Front-end processing shared by `LLM` and the HTTP server.

InputProcessor: prompt text or ids + SamplingParams -> engine Requests (validated, `n` fanned
out into child requests). OutputProcessor: EngineCoreOutputs -> RequestOutputs, with
incremental detokenization and stop strings (a matched stop string asks the engine to abort).
"""
from __future__ import annotations

import json
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config import EngineConfig
from slipstream.engine.request import Request
from slipstream.lora.request import LoRARequest
from slipstream.outputs import CompletionOutput, EngineCoreOutput, RequestMetrics, RequestOutput
from slipstream.sampling_params import SamplingParams
from slipstream.tokenizer.detokenizer import IncrementalDetokenizer


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def validate_prompt_tokens(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError for a prompt that can never run: empty, unknown token ids, or too long."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # C loops: the usual case is fast
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}: "
            "the prompt must leave room for at least one output token")


class ContextLengthError(ValueError):
    """A prompt that, with the tokens asked for, cannot fit the context; `param` names the field
    to change (the server answers 400 with code context_length_exceeded)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int,
                         prompt_param: str = "prompt",
                         tokens_param: str = "max_tokens") -> None:
    """ContextLengthError unless the prompt plus max_tokens (when set) fits max_model_len.

    The one length rule of the offline API and the server: nothing is cut to fit."""
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens; it must leave room for at least one output token.",
            prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or {tokens_param}.",
            tokens_param)


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of sample `index`: seed + index, wrapped into the signed 64-bit range."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


_PLAIN_INT = frozenset((int,))  # exactly int: bool is a subclass and must be refused


def as_token_ids(prompt: Any, field: str = "prompt") -> list[int]:
    """A list of ints from a sequence of integers (numpy ints too); floats, strings and bools
    are a ValueError, never converted."""
    if isinstance(prompt, (str, bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"{field} token ids must be a list of integers, got "
                         f"{type(prompt).__name__}")
    if type(prompt) is list and set(map(type, prompt)) <= _PLAIN_INT:  # the usual case, in C
        return list(prompt)
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            raise ValueError(f"{field} token ids must be integers, got {t!r}")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{field} token ids must be integers, got {t!r}") from None
    return ids


def read_eos_token_ids(config: EngineConfig, tokenizer: Any | None) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, merged."""
    ids = list(config.model.eos_token_ids)
    gen_path = Path(config.model_path) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if tokenizer is not None:
        ids += list(getattr(tokenizer, "eos_token_ids", ()) or ())
    return tuple(dict.fromkeys(int(i) for i in ids))


class InputProcessor:
    """Validates and tokenizes prompts; builds one Request per sample (`n`)."""

    def __init__(self, config: EngineConfig, tokenizer: Any | None):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = read_eos_token_ids(config, tokenizer)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
            return self.tokenizer.encode(prompt)
        return as_token_ids(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """The checks every entry point shares (LLM and the server alike)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params.validate()
        vocab = self.config.model.vocab_size
        max_len = self.config.scheduler.max_model_len
        validate_prompt_tokens(token_ids, vocab, max_len)
        check_context_length(len(token_ids), params.max_tokens, max_len)
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")

    def with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """bad_words as token ids, each word both as written and after a space (a word
        inside a sentence is usually one token with its leading space)."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer; use allowed_token_ids "
                             "or logit_bias with token ids")
        words = list(params.bad_words_token_ids or [])
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return params.clone(bad_words_token_ids=words)

    def process(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
        arrival_time: float | None = None, lora_request: LoRARequest | None = None,
    ) -> tuple[list[int], list[Request]]:
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params)
        params = self.with_bad_words_tokenized(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params.clone(n=1, seed=child_seed(params.seed, i))
            children.append(Request(
                request_id=child_request_id(request_id, i), prompt_token_ids=token_ids,
                sampling_params=child_params, eos_token_ids=self.eos_token_ids,
                priority=priority, arrival_time=arrival,
                **_lora_fields(lora_request),
            ))
        return token_ids, children


def _lora_fields(lora_request: LoRARequest | None) -> dict[str, Any]:
    if lora_request is None:
        return {}
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    return {"lora_int_id": lora_request.lora_int_id, "lora_path": lora_request.lora_path}


@dataclass
class _Choice:
    index: int
    detokenizer: Any | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0


class OutputProcessor:
    """Turns engine outputs into cumulative RequestOutputs, one per parent request."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, children: list[Request]) -> None:
        choices = [_Choice(i, None, logprobs=[] if params.logprobs is not None else None)
                   for i in range(len(children))]
        arrival = children[0].arrival_time if children else time.monotonic()
        self._parents[request_id] = _ParentState(
            request_id, prompt, prompt_token_ids, params, choices, RequestMetrics(arrival),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        for i, child in enumerate(children):
            self._child_to_parent[child.request_id] = (request_id, i)

    def _detokenizer(self, state: _ParentState, choice: _Choice):
        """The choice's detokenizer (None without a tokenizer), made when its first tokens
        arrive: making one decodes the prompt's tail, which add() would otherwise do for every
        prompt of an offline batch before the GPU starts (~0.1 ms each)."""
        if choice.detokenizer is None and self.tokenizer is not None:
            choice.detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                                        state.params)
        return choice.detokenizer

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent request; returns the child ids the engine must abort."""
        state = self._parents.pop(request_id, None)
        if state is None:
            return []
        ids = [child_request_id(request_id, c.index) for c in state.choices]
        for cid in ids:
            self._child_to_parent.pop(cid, None)
        return ids

    def process(
        self, outputs: list[EngineCoreOutput], emit_unfinished: bool = True,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply engine outputs; returns (updated outputs, child ids to abort: stop strings).

        emit_unfinished=False returns only finished requests (offline callers), which saves
        copying every running request's tokens each step.
        """
        touched: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        child_to_parent, parents = self._child_to_parent, self._parents
        for out in outputs:
            key = child_to_parent.get(out.request_id)
            if key is None:
                continue  # already aborted or finished by a stop string
            state = parents[key[0]]
            choice = state.choices[key[1]]
            if self._apply(state, choice, out, now):
                to_abort.append(out.request_id)
            if choice.finish_reason is not None:
                child_to_parent.pop(out.request_id, None)
                touched[state.request_id] = state
            elif emit_unfinished:  # (a parent finishes only in a step one of its choices does)
                touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = all(c.finish_reason is not None for c in state.choices)
            if finished:
                state.metrics.finished_time = now
                self._parents.pop(state.request_id, None)
            if finished or emit_unfinished:
                results.append(self._to_output(state, finished))
        return results, to_abort

    def _apply(self, state: _ParentState, choice: _Choice, out: EngineCoreOutput, now: float) -> bool:
        """Returns True when a stop string ended this choice (the engine must abort it)."""
        metrics = state.metrics
        if out.timestamps:
            metrics.absorb(out.timestamps)
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None and choice.index == 0:
            state.prompt_logprobs.extend(out.prompt_logprobs)
        if out.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        new_ids = out.new_token_ids
        if not new_ids:
            if out.finish_reason is not None:  # e.g. aborted or failed before a new token
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            return False
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.num_generated_tokens += len(new_ids)
        if out.num_draft_tokens:
            metrics.num_draft_tokens += out.num_draft_tokens
            metrics.num_accepted_tokens += out.num_accepted_tokens
        choice.token_ids.extend(new_ids)
        if choice.logprobs is not None and out.new_logprobs:
            choice.logprobs.extend(out.new_logprobs)
        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        detok = choice.detokenizer or self._detokenizer(state, choice)
        if detok is None:
            return False
        # An engine stop (EOS or a stop token id) keeps that token's text out of the output.
        detok.defer(new_ids, out.finish_reason == "stop")
        if detok.stop_matched is not None and out.finish_reason in (None, "stop", "length"):
            choice.finish_reason, choice.stop_reason = "stop", detok.stop_matched
            return out.finish_reason is None
        if choice.finish_reason is not None:
            detok.finalize()
        return False

    def _to_output(self, state: _ParentState, finished: bool) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=c.index, text=c.detokenizer.text if c.detokenizer is not None else "",
                token_ids=list(c.token_ids),
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )
            for c in state.choices
        ]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
            prompt_logprobs=state.prompt_logprobs, metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )
