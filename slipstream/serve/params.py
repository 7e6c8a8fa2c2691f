"""Turn an OpenAI request into SamplingParams, enforcing the server's caps and context limit.

Every failure is an APIError (400) that names the field and, for length problems, gives both
the model's context length and the requested number of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.engine.frontend import ContextLengthError, check_context_length
from slipstream.sampling_params import MAX_LOGPROBS, SamplingParams
from slipstream.serve.errors import APIError, from_value_error
from slipstream.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from slipstream.serve.structured import logit_control_kwargs, structured_outputs_of
from slipstream.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ServeLimits:
    """Caps that stop one request from taking the server down."""

    max_model_len: int
    max_n: int = 16
    max_logprobs: int = MAX_LOGPROBS
    max_tokens: int | None = None  # None: up to the context length
    max_prompts: int = 32  # prompts in one batched /v1/completions request
    max_request_bytes: int = 4 * 1024 * 1024
    vocab_size: int | None = None  # top_k at or above it means "off"
    request_timeout_s: float | None = None  # longest wait for a request's next output


def check_common(req: SamplingFields, limits: ServeLimits) -> None:
    if req.n > limits.max_n:
        raise APIError(f"n must be at most {limits.max_n}, got {req.n}", param="n")


def check_logprobs(value: int | None, limits: ServeLimits, param: str) -> None:
    if value is not None and value > limits.max_logprobs:
        raise APIError(f"{param} must be at most {limits.max_logprobs}, got {value}", param=param)


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: ServeLimits,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """max_tokens to run with: the request's, or what fits in the context when unset."""
    if limits.max_tokens is not None and requested is not None and requested > limits.max_tokens:
        raise APIError(f"{param} must be at most {limits.max_tokens}, got {requested}",
                       param=param)
    try:
        check_context_length(prompt_len, requested, limits.max_model_len, prompt_param, param)
    except ContextLengthError as exc:
        raise APIError(str(exc), param=exc.param, code="context_length_exceeded") from exc
    if requested is not None:
        return requested
    room = limits.max_model_len - prompt_len
    return room if limits.max_tokens is None else min(room, limits.max_tokens)


def _base_kwargs(req: SamplingFields, limits: ServeLimits) -> dict:
    kwargs: dict = dict(
        n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                          ("repetition_penalty", 1.0)):
        value = getattr(req, name)
        kwargs[name] = default if value is None else value
    if limits.vocab_size is not None and kwargs["top_k"] >= limits.vocab_size:
        kwargs["top_k"] = 0  # keeping every token is no top-k at all
    kwargs.update(logit_control_kwargs(req))
    structured = structured_outputs_of(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return kwargs


def _build(kwargs: dict) -> SamplingParams:
    if kwargs.get("min_tokens", 0) > (kwargs.get("max_tokens") or 0):
        raise APIError(f"min_tokens ({kwargs['min_tokens']}) must not exceed max_tokens "
                       f"({kwargs['max_tokens']})", param="min_tokens")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc) from exc


def completion_params(req: CompletionRequest, prompt_len: int,
                      limits: ServeLimits) -> SamplingParams:
    check_logprobs(req.logprobs, limits, "logprobs")
    kwargs = _base_kwargs(req, limits)
    kwargs["max_tokens"] = resolve_max_tokens(req.max_tokens, prompt_len, limits)
    kwargs["logprobs"] = req.logprobs
    if req.echo and req.logprobs is not None:
        kwargs["prompt_logprobs"] = req.logprobs
    return _build(kwargs)


def chat_params(req: ChatCompletionRequest, prompt_len: int, limits: ServeLimits,
                tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """tool_constraint: the output a "required" or named tool_choice forces."""
    check_logprobs(req.top_logprobs, limits, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    kwargs = _base_kwargs(req, limits)
    requested, param = req.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = req.max_tokens, "max_tokens"
    kwargs["max_tokens"] = resolve_max_tokens(requested, prompt_len, limits, param,
                                              prompt_param="messages")
    kwargs["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if tool_constraint is not None:
        if "structured_outputs" in kwargs:
            raise APIError("a required or named tool_choice cannot be combined with "
                           "response_format or guided_* constraints", param="tool_choice")
        kwargs["structured_outputs"] = tool_constraint
    return _build(kwargs)
