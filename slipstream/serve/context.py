"""What every route handler needs: the engine client, tokenizer, served name, limits, metrics.

`EngineClient` is the slice of AsyncLLM the HTTP layer uses, so tests can swap in a fake.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from slipstream.engine.async_llm import (
    EngineDeadError,
    EngineRestartingError,
    RequestAbortedError,
)
from slipstream.lora.request import LoRARequest
from slipstream.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams
from slipstream.serve.errors import APIError, error_body, from_value_error
from slipstream.serve.metrics import ServerMetrics
from slipstream.serve.params import ServeLimits
from slipstream.serve.tokenizing import PromptTokenizer
from slipstream.serve.tool_parsers import HermesParser, ToolParser

logger = logging.getLogger("slipstream.serve")


class EngineClient(Protocol):
    dead: asyncio.Event
    stats: dict[str, Any]

    @property
    def is_running(self) -> bool: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def get_stats(self, fresh: bool = False, timeout_s: float = 2.0) -> dict[str, Any]: ...


@dataclass
class ServeContext:
    engine: EngineClient
    tokenizer: Any
    model_name: str
    limits: ServeLimits
    metrics: ServerMetrics | None = None
    tool_parser: ToolParser = field(default_factory=HermesParser)  # --tool-call-parser
    loras: Any = None  # serve/lora.LoRARegistry with --enable-lora: adapter names are models
    prompts: PromptTokenizer | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self.prompts = PromptTokenizer(self.tokenizer, self.limits.max_model_len)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.lora_for(name) is None:
            raise APIError(f"The model `{name}` does not exist; this server serves "
                           f"`{self.model_name}`.", 404, param="model", code="model_not_found")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None (the base model)."""
        return self.loras.get(name) if self.loras is not None else None

    def response_model(self, name: str | None) -> str:
        """The model name a response carries: the adapter's when one was asked for."""
        return name if self.lora_for(name) is not None else self.model_name

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, tokenized off the event loop (serve/tokenizing.py)."""
        if self.prompts is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids",
                           param="prompt")
        return await self.prompts.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < vocab):  # C loops: the usual case is fast
            return
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
                           param=param)

    @property
    def vocab_size(self) -> int:
        config = getattr(self.engine, "config", None)
        if config is not None:
            return config.model.vocab_size
        return len(self.tokenizer)


def start_generation(ctx: ServeContext, prompt: list[int], params: SamplingParams,
                     request_id: str, priority: int, lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[RequestOutput]:
    """engine.generate with its errors turned into API errors (400 / 503), and the request
    timeout applied when one is set."""
    lora = {"lora_request": lora_request} if lora_request is not None else {}
    try:
        stream = ctx.engine.generate(prompt, params, request_id, priority, **lora)
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from exc
    except ValueError as exc:
        raise from_value_error(exc) from exc
    timeout_s = ctx.limits.request_timeout_s
    return stream if timeout_s is None else _with_timeout(stream, timeout_s)


async def _with_timeout(stream: AsyncIterator[RequestOutput],
                        timeout_s: float) -> AsyncIterator[RequestOutput]:
    """Fail with 504 when the next output takes longer than `timeout_s`: a queued or stalled
    request gives up, a stream still producing tokens never does."""
    it = aiter(stream)
    try:
        while True:
            try:
                out = await asyncio.wait_for(anext(it), timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise APIError(f"the request produced no output for {timeout_s:g} s "
                               "(the server's request timeout)", 504, code="timeout") from None
            yield out
    finally:
        await it.aclose()  # type: ignore[attr-defined]


def engine_dead_error(exc: Exception | None = None) -> APIError:
    if isinstance(exc, EngineRestartingError):
        return APIError(str(exc), 503, code="engine_restarting", headers={"retry-after": "2"})
    return APIError(f"The engine is not running: {exc or 'it was shut down'}.", 503,
                    code="engine_dead")


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception from the engine path to what the client may see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead_error(exc)
    if isinstance(exc, RequestAbortedError):
        return APIError("the request was aborted", 503, code="aborted")
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    logger.error("internal error while generating", exc_info=exc)
    return APIError("internal server error", 500)


def stream_error_event(exc: BaseException) -> str:
    """JSON of the error event sent in a stream whose status line has gone out already."""
    err = to_api_error(exc)
    return json.dumps(error_body(err.message, err.status, err.param, err.code))


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise RuntimeError("engine stream ended without output")
    return last
