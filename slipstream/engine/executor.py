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
from slipstream.lora.request import LoRARequest
from slipstream.sampling_params import SamplingParams


@dataclass
class Response:
    """News of one request. Streaming: the tokens (and logprobs) new since the last response;
    otherwise every output token, in the final response. finish_reason: "stop", "length",
    "cancelled" or "error" on the final response, else None. A request with n sequences
    (`SamplingParams.n`) gets responses for each: `index` (0..n-1) says which, `is_final` ends
    that sequence, and the request is done once each of its n sequences has had its final one."""

    request_id: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    is_final: bool
    error: str | None = None
    index: int = 0


class Executor:
    """`Executor(model_or_engine_dir, **engine_args)`; a context manager that shuts down."""

    def __init__(self, model: str | None = None, *, startup_timeout_s: float = 1800.0,
                 **engine_args: Any) -> None:
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self._cond = threading.Condition()
        self._queued: dict[int, list[Response]] = {}
        # enqueued request -> its sequences whose final response no caller has taken yet
        self._open: dict[int, int] = {}
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
                        priority: int = 0, lora_request: LoRARequest | None = None) -> int:
        """Queue a request; returns its id. A bad request raises ValueError here."""
        params = sampling_params or SamplingParams()
        with self._cond:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            request_id = next(self._ids)
            self._open[request_id] = params.n
        try:
            self._call(self._start(request_id, list(prompt_token_ids), params, streaming,
                                   priority, lora_request))
        except BaseException:
            with self._cond:
                self._open.pop(request_id, None)
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
            for r in out:
                if r.is_final:
                    self._close_sequence(r.request_id)
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

    def _close_sequence(self, request_id: int) -> None:
        self._open[request_id] -= 1
        if not self._open[request_id]:
            del self._open[request_id]

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
                     streaming: bool, priority: int, lora_request: LoRARequest | None) -> None:
        stream = self._llm.generate(prompt, params, str(request_id), priority,
                                    lora_request=lora_request)  # may raise
        asyncio.get_running_loop().create_task(
            self._pump(request_id, stream, streaming, params.n))

    async def _pump(self, request_id: int, stream, streaming: bool, n: int) -> None:
        """Turn one request's RequestOutputs into Responses, each sequence's up to its final
        one (a sequence may finish before the others)."""
        sent = [0] * n  # tokens already sent, per sequence (streaming)
        done = [False] * n
        try:
            async for out in stream:
                for c in out.outputs:
                    if done[c.index]:
                        continue
                    final = out.finished or c.finish_reason is not None
                    reason = _finish_reason(c.finish_reason) if final else None
                    start = sent[c.index] if streaming else 0
                    if final or (streaming and len(c.token_ids) > start):
                        lps = c.logprobs[start:] if c.logprobs is not None else None
                        self._push(Response(request_id, list(c.token_ids[start:]), lps, reason,
                                            final, index=c.index))
                        sent[c.index], done[c.index] = len(c.token_ids), final
        except RequestAbortedError:
            self._end_open(request_id, done, "cancelled")
        except (EngineDeadError, ValueError) as exc:
            self._end_open(request_id, done, "error", str(exc))

    def _end_open(self, request_id: int, done: list[bool], reason: str,
                  error: str | None = None) -> None:
        """A final response for each sequence not yet ended."""
        for i, ended in enumerate(done):
            if not ended:
                self._push(Response(request_id, [], None, reason, True, error=error, index=i))


def _finish_reason(reason: str | None) -> str:
    return "cancelled" if reason in (None, "abort") else reason
