"""AsyncLLM: the engine core in its own process, with one async stream per request.

The front end tokenizes and detokenizes; requests go to the engine process over ZeroMQ (msgpack)
and a background task routes its outputs to per-request streams.

The front end also supervises the engine. The engine's messages are its heartbeat: while it
has requests it sends at least one per step. When the process exits, or has work and sends
nothing for `Supervision.hang_timeout_s`, the requests in flight fail with EngineDeadError, the
process is killed and a new one started (with a back-off, up to `max_restarts` in a row).
While it restarts, `is_running` is False and new requests get EngineRestartingError. Past the
cap, `dead` is set and stays set.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from slipstream.config import EngineConfig
from slipstream.engine.core_proc import (
    decode_beam_output,
    decode_output,
    encode_request,
    pack,
    unpack,
)
from slipstream.engine.engine_proc import EngineProcess, remove_stale_ipc_dirs
from slipstream.engine.frontend import InputProcessor, OutputProcessor
from slipstream.lora.request import LoRARequest
from slipstream.outputs import EngineCoreOutput, RequestMetrics, RequestOutput
from slipstream.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchUpdate
from slipstream.sampling_params import SamplingParams

logger = logging.getLogger("slipstream.engine.async_llm")

POLL_MS = 100  # how often the output loop checks the engine's health when it is quiet


class EngineDeadError(RuntimeError):
    """The engine process died or hung: the requests it held are lost."""


class EngineRestartingError(EngineDeadError):
    """The engine is being restarted; a new request may be retried shortly."""


class RequestAbortedError(RuntimeError):
    """The request was aborted while someone was still reading its stream."""


@dataclass(frozen=True)
class Supervision:
    """How the front end watches and restarts the engine process."""

    hang_timeout_s: float | None = 60.0  # with work and no message this long: hung (None: off)
    max_restarts: int = 5  # restarts in a row before giving up (0: never restart)
    backoff_s: float = 1.0  # wait before a restart, doubled for each one in a row
    max_backoff_s: float = 30.0
    stable_after_s: float = 300.0  # serving this long makes the next failure the first again


class StatLogger(Protocol):
    def on_request_start(self, num_prompt_tokens: int) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None: ...
    def on_request_finished(self, reasons: list[str], e2e_s: float | None,
                            metrics: RequestMetrics | None) -> None: ...


class _RequestStream:
    """Latest cumulative RequestOutput of one request; outputs coalesce if the reader lags."""

    def __init__(self) -> None:
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.latest is not None:
            out, self.latest = self.latest, None
            if self.error is not None:
                self.event.set()  # deliver the error on the next call
            return out
        assert self.error is not None
        raise self.error


class AsyncLLM:
    """Use `await AsyncLLM.create(config)`; then `generate`, `abort`, `get_stats`, `shutdown`."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None,
                 stat_logger: StatLogger | None = None,
                 supervision: Supervision | None = None) -> None:
        self.config = config
        self.stat_logger = stat_logger
        self.supervision = supervision or Supervision()
        self.set_tokenizer(tokenizer)
        self.stats: dict[str, Any] = {}
        self.dead = asyncio.Event()
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self._restarting = False
        self._shutting_down = False
        self._failures_in_a_row = 0
        self._serving_since = time.monotonic()
        self._failed = asyncio.Event()
        self._failure_reason = ""
        self._streams: dict[str, _RequestStream] = {}
        self._pooling: dict[str, asyncio.Future] = {}  # pooling requests (encode) by id
        # Beam searches by id: their updates, then the result (or an error), in order.
        self._beams: dict[str, asyncio.Queue] = {}
        self._child_parent: dict[str, str] = {}
        self._last_token_time: dict[str, float] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._sending = False  # the send loop is inside a send
        self._tasks: list[asyncio.Task] = []  # the current engine's socket loops
        self._supervisor: asyncio.Task | None = None
        self._engine: EngineProcess | None = None
        self._startup_timeout_s = 1800.0
        self._ctx = zmq.asyncio.Context()

    @classmethod
    async def create(cls, config: EngineConfig, tokenizer: Any | None = None,
                     stat_logger: StatLogger | None = None,
                     startup_timeout_s: float = 1800.0,
                     supervision: Supervision | None = None) -> AsyncLLM:
        """Start the engine process; loads the tokenizer (if not given) while it starts."""
        remove_stale_ipc_dirs()
        llm = cls(config, tokenizer, stat_logger, supervision)
        llm._startup_timeout_s = startup_timeout_s
        atexit.register(llm._remove_ipc_dir)
        try:
            llm._engine = EngineProcess(llm._ctx, config)
            if tokenizer is None:
                # Lazy: transformers loads only when the caller gave no tokenizer.
                from slipstream.tokenizer.tokenizer import load_tokenizer

                path = config.tokenizer_path or config.model_path
                try:
                    llm.set_tokenizer(await asyncio.to_thread(load_tokenizer, path))
                except (OSError, ValueError) as exc:
                    logger.warning("no tokenizer in %s (%s): serving token-id prompts only, "
                                   "outputs carry no text", path, str(exc).splitlines()[0][:120])
            llm.stats = await llm._engine.wait_ready(startup_timeout_s)
        except BaseException:
            await llm.shutdown()
            raise
        llm._start_loops()
        llm._supervisor = asyncio.create_task(llm._supervise(), name="engine-supervisor")
        return llm

    @classmethod
    async def from_engine_args(cls, engine_args: Any, tokenizer: Any | None = None,
                               stat_logger: StatLogger | None = None,
                               startup_timeout_s: float = 1800.0) -> AsyncLLM:
        """`await AsyncLLM.from_engine_args(EngineArgs(model=...))`: create() with the config
        of those arguments (the model may be a built engine directory)."""
        config = engine_args.create_engine_config()
        return await cls.create(config, tokenizer, stat_logger, startup_timeout_s)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)

    # ------------------------------------------------------------------ process lifecycle

    @property
    def pid(self) -> int | None:
        return self._engine.pid if self._engine is not None else None

    @property
    def is_running(self) -> bool:
        return (not self.dead.is_set() and not self._restarting and not self._failed.is_set()
                and self._engine is not None and self._engine.exit_code() is None)

    def health_stats(self) -> dict[str, Any]:
        """For /metrics: whether the engine serves now, and how often it was restarted."""
        return {"engine_up": int(self.is_running), "engine_restarts": self.num_restarts}

    def _start_loops(self) -> None:
        engine = self._engine
        self._tasks = [asyncio.create_task(self._output_loop(engine), name="engine-outputs"),
                       asyncio.create_task(self._send_loop(engine), name="engine-inputs")]

    async def _stop_loops(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        self._shutting_down = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._stop_loops()
        if self._engine is not None:
            await self._engine.stop(timeout_s, pack({"t": "shutdown"}))
        self._mark_dead("the engine was shut down")
        self._ctx.term()

    def _remove_ipc_dir(self) -> None:
        """atexit: whatever way the front end leaves, the engine's sockets go with it."""
        if self._engine is not None:
            shutil.rmtree(self._engine.ipc_dir, ignore_errors=True)

    def _report_failure(self, reason: str) -> None:
        """Hand the engine to the supervisor (from a socket loop, which it will cancel)."""
        if not self._failed.is_set() and not self._shutting_down:
            self._failure_reason = reason
            self._failed.set()

    async def _supervise(self) -> None:
        while True:
            await self._failed.wait()
            reason = self._failure_reason
            logger.error("engine failed: %s", reason)
            await self._stop_loops()
            if self._engine is not None:
                await self._engine.stop()
            self._fail_in_flight(EngineDeadError(
                f"{reason}; requests in flight were lost"
                + ("" if self._may_restart() else " and the engine is not restarted")))
            if not self._may_restart():
                self._mark_dead(f"{reason}; restart limit ({self.supervision.max_restarts}) "
                                "reached")
                return
            await self._restart()

    def _may_restart(self) -> bool:
        if time.monotonic() - self._serving_since > self.supervision.stable_after_s:
            self._failures_in_a_row = 0
        return self._failures_in_a_row < self.supervision.max_restarts

    async def _restart(self) -> None:
        sup = self.supervision
        self._restarting = True
        self._failed.clear()
        self._failures_in_a_row += 1
        self.num_restarts += 1
        delay = min(sup.backoff_s * 2 ** (self._failures_in_a_row - 1), sup.max_backoff_s)
        logger.warning("restarting the engine in %.1f s (restart %d in a row, at most %d)",
                       delay, self._failures_in_a_row, sup.max_restarts)
        await asyncio.sleep(delay)
        try:
            self._engine = EngineProcess(self._ctx, self.config)
            self.stats = await self._engine.wait_ready(self._startup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - counts as one more failure in a row
            self._restarting = False
            self._report_failure(f"engine restart failed: {exc}")
            return
        self._outbox = asyncio.Queue()
        self._start_loops()
        self._serving_since = time.monotonic()
        self._restarting = False
        logger.warning("engine restarted (pid %s)", self._engine.pid)

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        """Fail every request the lost engine held; forget them (nothing to abort there)."""
        for parent in set(self._child_parent.values()) | set(self._streams):
            self.output_processor.abort(parent)
        self._child_parent.clear()
        self._last_token_time.clear()
        for stream in self._streams.values():
            stream.fail(error)
        for fut in self._pooling.values():
            if not fut.done():
                fut.set_exception(error)
        for queue in self._beams.values():
            queue.put_nowait(error)
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(error)
        self._stats_waiters.clear()
        self.stats = {}

    def _mark_dead(self, reason: str) -> None:
        if self.dead.is_set():
            return
        self.dead_reason = reason
        self.dead.set()
        self._fail_in_flight(EngineDeadError(reason))

    # ------------------------------------------------------------------ socket loops

    def _send(self, msg: dict) -> None:
        """Send a message to the engine, in order (packed here, so a bad value fails now)."""
        self._send_packed(pack(msg))

    def _send_packed(self, data: bytes) -> None:
        """Send now when nothing is queued before it (an idle engine starts on the request
        while this handler still runs); else queue it behind the rest for the send loop."""
        engine = self._engine
        if (self._sending or not self._outbox.empty() or not self._tasks or engine is None
                or self._failed.is_set()):
            self._outbox.put_nowait(data)
            return
        try:
            sent = engine.to_engine.send(data)
        except zmq.ZMQError as exc:  # the supervisor fails the requests in flight, this one too
            self._report_failure(f"sending to the engine failed: {exc}")
            return
        if not sent.done():  # the socket's own queue keeps it ahead of later sends
            sent.add_done_callback(self._check_sent)
        else:
            self._check_sent(sent)

    def _check_sent(self, sent: asyncio.Future) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._report_failure(f"sending to the engine failed: {sent.exception()}")

    async def _send_loop(self, engine: EngineProcess) -> None:
        while True:
            data = await self._outbox.get()
            self._sending = True
            try:
                await engine.to_engine.send(data)
            finally:
                self._sending = False

    async def _output_loop(self, engine: EngineProcess) -> None:
        try:
            while True:
                if await engine.from_engine.poll(POLL_MS):
                    engine.last_progress = time.monotonic()
                    while True:
                        try:
                            raw = engine.from_engine.recv(zmq.NOBLOCK).result()
                        except zmq.Again:
                            break
                        self._handle(unpack(raw))
                else:
                    self._check_health(engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("engine output loop failed")
            self._report_failure(f"engine output loop failed: {exc}")

    def _check_health(self, engine: EngineProcess) -> None:
        code = engine.exit_code()
        if code is not None:
            self._report_failure(f"engine process exited with code {code}")
            return
        hang_s = self.supervision.hang_timeout_s
        quiet_s = time.monotonic() - engine.last_progress
        if hang_s is not None and self._child_parent and quiet_s > hang_s:
            self._report_failure(f"engine made no progress for {quiet_s:.1f} s with "
                                 f"{len(self._child_parent)} sequences in flight (hung)")

    def _handle(self, msg: dict) -> None:
        kind = msg["t"]
        if kind == "outputs":
            self._on_outputs([decode_output(d) for d in msg["outs"]])
        elif kind == "stats":
            self.stats = msg["stats"]
            if msg.get("reply"):
                for fut in self._stats_waiters:
                    if not fut.done():
                        fut.set_result(self.stats)
                self._stats_waiters.clear()
        elif kind == "beam_progress":
            queue = self._beams.get(msg["id"])
            if queue is not None:
                queue.put_nowait(BeamSearchUpdate(list(msg["tokens"])))
        elif kind == "beam_done":
            queue = self._beams.get(msg["id"])
            if queue is not None:
                queue.put_nowait(BeamSearchUpdate([], decode_beam_output(msg["out"])))
        elif kind == "req_error":
            self._on_request_error(msg.get("id"), msg.get("msg", "invalid request"))
        elif kind == "fatal":
            logger.error("engine core reported a fatal error: %s", msg.get("msg"))
            self._report_failure(f"engine core failed: {msg.get('msg')}")

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if self._pooling:
            outputs = self._take_pooled(outputs)
        now = time.monotonic()
        self._record_token_stats(outputs, now)
        request_outputs, to_abort = self.output_processor.process(outputs)
        if to_abort:  # stop strings matched in the front end: free the engine's blocks now
            self._send({"t": "abort", "ids": to_abort})
        for ro in request_outputs:
            if ro.finished:
                self._on_finished(ro, now)
            stream = self._streams.get(ro.request_id)
            if stream is not None:
                stream.put(ro)

    def _take_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Resolve the encode() futures of finished pooling requests; the rest go on."""
        rest = []
        for out in outputs:
            fut = self._pooling.get(out.request_id)
            if fut is None:
                rest.append(out)
            elif out.finished and not fut.done():
                fut.set_result(out.pooled)
        return rest

    def _on_request_error(self, child_id: str | None, message: str) -> None:
        fut = self._pooling.get(child_id or "")
        if fut is not None and not fut.done():
            fut.set_exception(ValueError(message))
        queue = self._beams.get(child_id or "")
        if queue is not None:
            queue.put_nowait(ValueError(message))
        parent = self._child_parent.get(child_id or "")
        if parent is None:
            return
        self._abort_now(parent, record=False)
        stream = self._streams.get(parent)
        if stream is not None:
            stream.fail(ValueError(message))

    # ------------------------------------------------------------------ metrics hooks

    def _record_token_stats(self, outputs: list[EngineCoreOutput], now: float) -> None:
        if self.stat_logger is None:
            return
        for out in outputs:
            k = len(out.new_token_ids)
            if k == 0 or out.request_id not in self._child_parent:
                continue  # nothing new, or news for a request already aborted
            last = self._last_token_time.get(out.request_id)
            self._last_token_time[out.request_id] = now
            itl = None if last is None else (now - last) / k
            self.stat_logger.on_tokens(k, itl)

    def _on_finished(self, ro: RequestOutput, now: float) -> None:
        for c in ro.outputs:
            cid = f"{ro.request_id}-{c.index}"
            self._child_parent.pop(cid, None)
            self._last_token_time.pop(cid, None)
        if self.stat_logger is None or ro.metrics is None:
            return
        e2e = now - ro.metrics.arrival_time
        self.stat_logger.on_request_finished(
            [c.finish_reason or "abort" for c in ro.outputs], e2e, ro.metrics)

    # ------------------------------------------------------------------ public API

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Queue a request now and return its stream of cumulative RequestOutputs.

        Invalid input raises ValueError (and a dead engine EngineDeadError) here, before any
        await, so a server can answer 400 before it starts a stream. Leaving the stream early
        or being cancelled aborts the request; call `abort` if the stream is never iterated.
        """
        if self.dead.is_set():
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not self.is_running:
            raise EngineRestartingError("the engine is restarting after a failure; retry shortly")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.config.runner == "pooling":
            raise ValueError("this server runs a pooling model: use /v1/embeddings")
        prompt_ids, children = self.input_processor.process(request_id, prompt, params, priority,
                                                            lora_request=lora_request)
        try:
            add_msg = pack({"t": "add", "reqs": [encode_request(c) for c in children]})
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"the request holds a value the engine cannot take: {exc}") from exc
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                  prompt_ids, params, children)
        stream = _RequestStream()
        self._streams[request_id] = stream
        if not self._child_parent:  # idle until now: the hang clock starts with this work
            self._engine.last_progress = time.monotonic()
        for child in children:
            self._child_parent[child.request_id] = request_id
        self._send_packed(add_msg)
        if self.stat_logger is not None:
            self.stat_logger.on_request_start(len(prompt_ids))
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str,
                       stream: _RequestStream) -> AsyncIterator[RequestOutput]:
        finished = False
        first = True
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if first and self.stat_logger is not None and out.metrics is not None:
                    ttft = out.metrics.time_to_first_token
                    if ttft is not None:
                        first = False
                        self.stat_logger.on_first_token(ttft)
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def encode(self, prompt_ids: list[int], pooling_params: dict[str, Any],
                     request_id: str) -> list[float]:
        """A pooling model's vector for one prompt (token ids, validated by the caller).
        Cancelling the wait aborts the request."""
        if self.dead.is_set():
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not self.is_running:
            raise EngineRestartingError("the engine is restarting after a failure; retry shortly")
        if request_id in self._pooling or request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        from slipstream.engine.request import Request

        request = Request(request_id, prompt_ids, SamplingParams(max_tokens=1, ignore_eos=True),
                          pooling_params=pooling_params)
        fut = asyncio.get_running_loop().create_future()
        self._pooling[request_id] = fut
        self._send({"t": "add", "reqs": [encode_request(request)]})
        answered = False
        try:
            vector = await fut
            answered = True
            return vector
        finally:
            self._pooling.pop(request_id, None)
            if not answered and not self.dead.is_set():
                self._send({"t": "abort", "ids": [request_id]})

    async def beam_search(self, prompt_ids: list[int], params: BeamSearchParams,
                          request_id: str, priority: int = 0) -> BeamSearchOutput:
        """Run a beam search (engine/beam.py) and return its hypotheses, best first (token
        ids; no text). Cancelling the wait aborts the search."""
        updates = self.beam_search_stream(prompt_ids, params, request_id, priority)
        async with contextlib.aclosing(updates):
            async for update in updates:
                if update.output is not None:
                    return update.output
        raise RuntimeError(f"beam search {request_id} ended without a result")

    async def beam_search_stream(self, prompt_ids: list[int], params: BeamSearchParams,
                                 request_id: str, priority: int = 0
                                 ) -> AsyncIterator[BeamSearchUpdate]:
        """Run a beam search, yielding the tokens every hypothesis begins with as they settle,
        then (last) the result. Leaving the loop early, or `abort(request_id)`, aborts it."""
        if self.dead.is_set():
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not self.is_running:
            raise EngineRestartingError("the engine is restarting after a failure; retry shortly")
        if request_id in self._beams or request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.input_processor.validate_prompt(prompt_ids, SamplingParams())
        queue: asyncio.Queue = asyncio.Queue()
        self._beams[request_id] = queue
        self._send({"t": "beam", "id": request_id, "prompt": list(prompt_ids),
                    "params": dataclasses.asdict(params), "priority": priority,
                    "eos": list(self.input_processor.eos_token_ids)})
        answered = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.output is not None:
                    answered = True
                    self._forget_beams(request_id, queue)
                yield item
                if answered:
                    return
        finally:
            self._forget_beams(request_id, queue)
            if not answered and not self.dead.is_set():
                self._send({"t": "abort", "ids": [request_id]})

    def _forget_beams(self, request_id: str, queue: asyncio.Queue) -> None:
        if self._beams.get(request_id) is queue:
            del self._beams[request_id]

    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent: a finished or unknown id is ignored).

        A reader still waiting on its stream gets RequestAbortedError."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(RequestAbortedError(f"request {request_id} was aborted"))
        beams = self._beams.pop(request_id, None)
        if beams is not None:
            beams.put_nowait(RequestAbortedError(f"beam search {request_id} was aborted"))
            if self.is_running:
                self._send({"t": "abort", "ids": [request_id]})
        self._abort_now(request_id)

    def _abort_now(self, request_id: str, record: bool = True) -> None:
        """Synchronous so it can run in a cancelled generator's `finally`."""
        child_ids = self.output_processor.abort(request_id)
        for cid in child_ids:
            self._child_parent.pop(cid, None)
            self._last_token_time.pop(cid, None)
        if child_ids and self.is_running:
            self._send({"t": "abort", "ids": child_ids})
        if child_ids and record and self.stat_logger is not None:
            self.stat_logger.on_request_finished(["abort"] * len(child_ids), None, None)

    async def get_stats(self, fresh: bool = False, timeout_s: float = 2.0) -> dict[str, Any]:
        """Latest engine stats; `fresh` asks the engine for a snapshot taken after this call."""
        if not fresh or not self.is_running:
            return dict(self.stats)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._send({"t": "stats"})
        try:
            return dict(await asyncio.wait_for(asyncio.shield(fut), timeout_s))
        except (TimeoutError, EngineDeadError):
            return dict(self.stats)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

