"""Executor: a thread-safe, synchronous request API over the engine process.

`enqueue_request` returns an id at once; `await_responses` blocks until results arrive (partial
ones for streaming requests, one final one otherwise); `cancel_request` stops a request, which
then gets a final response with finish reason "cancelled". The engine core runs in its own
process (AsyncLLM, the server's machinery), driven from one private event-loop thread, so the
caller's threads never share a GIL with the model and any number of them may call at once.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.engine.args import EngineArgs
from slipstream.engine.async_llm import AsyncLLM, EngineDeadError, RequestAbortedError
from slipstream.sampling_params import SamplingParams


@dataclass
class Response:
    """News of one request. Streaming: the tokens (and logprobs) new since the last response;
    otherwise every output token, in the final response. finish_reason: "stop", "length",
    "cancelled" or "error" on the final response, else None."""

    request_id: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    is_final: bool
    error: str | None = None


class Executor:
    """`Executor(model_or_engine_dir, **engine_args)`; a context manager that shuts down."""

    def __init__(self, model: str | None = None, *, startup_timeout_s: float = 1800.0,
                 **engine_args: Any) -> None:
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self._cond = threading.Condition()
        self._queued: dict[int, list[Response]] = {}
        self._open: set[int] = set()  # enqueued, final response not yet taken by a caller
        self._ids = itertools.count()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slipstream-executor",
                                        daemon=True)
        self._thread.start()
        try:
            self._llm: AsyncLLM = self._call(AsyncLLM.create(
                config, startup_timeout_s=startup_timeout_s))
        except BaseException:
            self._stop_loop()
            raise
        self.config = config

    # ------------------------------------------------------------------ public API

    def enqueue_request(self, prompt_token_ids: Sequence[int],
                        sampling_params: SamplingParams | None = None, streaming: bool = False,
                        priority: int = 0, lora_request: Any = None) -> int:
        """Queue a request; returns its id. A bad request raises ValueError here."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported by this engine")
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"the executor serves one sequence a request, got n={params.n}")
        with self._cond:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            request_id = next(self._ids)
            self._open.add(request_id)
        try:
            self._call(self._start(request_id, list(prompt_token_ids), params, streaming,
                                   priority))
        except BaseException:
            with self._cond:
                self._open.discard(request_id)
            raise
        return request_id

    def await_responses(self, request_id: int | None = None,
                        timeout: float | None = None) -> list[Response]:
        """Responses ready for `request_id` (None: for any request), waiting up to `timeout`
        seconds (None: until one is ready) for the first; [] when the time runs out, or when
        request_id is None and no request is open."""
        with self._cond:
            if request_id is not None and request_id not in self._open:
                raise ValueError(f"request {request_id} is unknown or its final response was "
                                 "already returned")
            if request_id is None and not self._open:
                return []
            self._cond.wait_for(lambda: self._ready(request_id), timeout)
            ids = [request_id] if request_id is not None else list(self._queued)
            out = [r for rid in ids for r in self._queued.pop(rid, [])]
            self._open.difference_update(r.request_id for r in out if r.is_final)
            return out

    def cancel_request(self, request_id: int) -> None:
        """Stop a request; it gets a final response with finish reason "cancelled" (unless it
        finished first). Unknown or finished ids are ignored."""
        if not self._closed:
            self._call(self._llm.abort(str(request_id)))

    def get_latest_iteration_stats(self) -> dict[str, Any]:
        """The engine's latest step and state: batch size (num_running), waiting requests, KV
        blocks free and used, the last step's time and new tokens, iterations so far."""
        if self._closed:
            raise RuntimeError("the executor is shut down")
        return self._call(self._llm.get_stats(fresh=True))

    def shutdown(self) -> None:
        """Stop the engine process; requests still running get a final error response."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._call(self._llm.shutdown())
        finally:
            self._stop_loop()
            with self._cond:
                self._cond.notify_all()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _call(self, coro) -> Any:
        """Run a coroutine on the executor's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _ready(self, request_id: int | None) -> bool:
        if self._closed and not self._thread.is_alive():
            return True
        if request_id is None:
            return any(self._queued.values())
        return bool(self._queued.get(request_id))

    def _push(self, response: Response) -> None:
        with self._cond:
            self._queued.setdefault(response.request_id, []).append(response)
            self._cond.notify_all()

    async def _start(self, request_id: int, prompt: list[int], params: SamplingParams,
                     streaming: bool, priority: int) -> None:
        stream = self._llm.generate(prompt, params, str(request_id), priority)  # may raise
        asyncio.get_running_loop().create_task(self._pump(request_id, stream, streaming))

    async def _pump(self, request_id: int, stream, streaming: bool) -> None:
        """Turn one request's RequestOutputs into Responses until its final one."""
        sent = 0
        try:
            async for out in stream:
                c = out.outputs[0]
                reason = _finish_reason(c.finish_reason) if out.finished else None
                if streaming and (len(c.token_ids) > sent or out.finished):
                    lps = c.logprobs[sent:] if c.logprobs is not None else None
                    self._push(Response(request_id, list(c.token_ids[sent:]), lps, reason,
                                        out.finished))
                    sent = len(c.token_ids)
                elif out.finished:
                    self._push(Response(request_id, list(c.token_ids), c.logprobs, reason, True))
        except RequestAbortedError:
            self._push(Response(request_id, [], None, "cancelled", True))
        except (EngineDeadError, ValueError) as exc:
            self._push(Response(request_id, [], None, "error", True, error=str(exc)))


def _finish_reason(reason: str | None) -> str:
    return "cancelled" if reason in (None, "abort") else reason
