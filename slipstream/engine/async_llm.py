"""AsyncLLM: the engine core in its own process, with one async stream per request.

The front end tokenizes and detokenizes; requests go to the engine process over ZeroMQ (msgpack)
and a background task routes its outputs to per-request streams. If the engine process dies,
every in-flight request fails with EngineDeadError and `dead` is set.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import zmq
import zmq.asyncio

from slipstream.config import EngineConfig
from slipstream.engine.core_proc import (
    config_to_dict,
    decode_beam_output,
    decode_output,
    encode_request,
    pack,
    unpack,
)
from slipstream.engine.frontend import InputProcessor, OutputProcessor
from slipstream.outputs import EngineCoreOutput, RequestOutput
from slipstream.sampling.beam_search import BeamSearchOutput, BeamSearchParams
from slipstream.sampling_params import SamplingParams

logger = logging.getLogger("slipstream.engine.async_llm")

POLL_MS = 500  # how often the output loop checks that the engine process is alive


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more will be served."""


class RequestAbortedError(RuntimeError):
    """The request was aborted while someone was still reading its stream."""


class StatLogger(Protocol):
    def on_request_start(self, num_prompt_tokens: int) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None: ...
    def on_request_finished(self, reasons: list[str], e2e_s: float | None,
                            queue_s: float | None) -> None: ...


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
                 stat_logger: StatLogger | None = None) -> None:
        self.config = config
        self.stat_logger = stat_logger
        self.set_tokenizer(tokenizer)
        self.stats: dict[str, Any] = {}
        self.dead = asyncio.Event()
        self.dead_reason: str | None = None
        self._streams: dict[str, _RequestStream] = {}
        self._pooling: dict[str, asyncio.Future] = {}  # pooling requests (encode) by id
        self._beams: dict[str, asyncio.Future] = {}  # beam searches by id
        self._child_parent: dict[str, str] = {}
        self._last_token_time: dict[str, float] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._proc: subprocess.Popen | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="slipstream-")
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)

    @classmethod
    async def create(cls, config: EngineConfig, tokenizer: Any | None = None,
                     stat_logger: StatLogger | None = None,
                     startup_timeout_s: float = 1800.0) -> AsyncLLM:
        """Start the engine process; loads the tokenizer (if not given) while it starts."""
        llm = cls(config, tokenizer, stat_logger)
        try:
            llm._spawn()
            if tokenizer is None:
                # Lazy: transformers loads only when the caller gave no tokenizer.
                from slipstream.tokenizer.tokenizer import load_tokenizer

                path = config.tokenizer_path or config.model_path
                try:
                    llm.set_tokenizer(await asyncio.to_thread(load_tokenizer, path))
                except (OSError, ValueError) as exc:
                    logger.warning("no tokenizer in %s (%s): serving token-id prompts only, "
                                   "outputs carry no text", path, str(exc).splitlines()[0][:120])
            await llm._wait_ready(startup_timeout_s)
        except BaseException:
            await llm.shutdown()
            raise
        llm._tasks = [asyncio.create_task(llm._output_loop(), name="engine-outputs"),
                      asyncio.create_task(llm._send_loop(), name="engine-inputs")]
        return llm

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)

    # ------------------------------------------------------------------ process lifecycle

    def _spawn(self) -> None:
        input_addr = f"ipc://{self._ipc_dir}/in"
        output_addr = f"ipc://{self._ipc_dir}/out"
        self._to_engine.bind(input_addr)
        self._from_engine.bind(output_addr)
        # Own session: a Ctrl-C on the terminal (or a signal to our process group) reaches the
        # front end only, which then shuts the engine down in order.
        self._proc = subprocess.Popen([sys.executable, "-m", "slipstream.engine.core_proc"],
                                      stdin=subprocess.PIPE, start_new_session=True)
        header = {"config": config_to_dict(self.config), "input_addr": input_addr,
                  "output_addr": output_addr}
        self._proc.stdin.write(json.dumps(header).encode() + b"\n")
        self._proc.stdin.flush()  # stdin stays open: its EOF tells the engine we are gone

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._from_engine.poll(POLL_MS):
                msg = unpack(await self._from_engine.recv())
                if msg["t"] == "ready":
                    self.stats = msg["stats"]
                    return
                if msg["t"] == "fatal":
                    raise RuntimeError(f"engine failed to start: {msg['msg']}")
            elif self._proc.poll() is not None:
                raise RuntimeError(f"engine process exited with code {self._proc.returncode} "
                                   "during start-up (see its log above)")
        raise RuntimeError(f"engine did not start within {timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return not self.dead.is_set() and self._proc is not None and self._proc.poll() is None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._proc is not None and self._proc.poll() is None and self._tasks:
            self._send({"t": "shutdown"})
            with contextlib.suppress(asyncio.TimeoutError, subprocess.TimeoutExpired):
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait, timeout_s), timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._proc is not None:
            _stop_process(self._proc)
        self._mark_dead("the engine was shut down")
        self._to_engine.close(0)
        self._from_engine.close(0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _mark_dead(self, reason: str) -> None:
        if self.dead.is_set():
            return
        self.dead_reason = reason
        self.dead.set()
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.fail(error)
        for fut in [*self._pooling.values(), *self._beams.values()]:
            if not fut.done():
                fut.set_exception(error)
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(error)
        self._stats_waiters.clear()

    # ------------------------------------------------------------------ socket loops

    def _send(self, msg: dict) -> None:
        """Queue a message for the engine, in order (packed here, so a bad value fails now)."""
        self._outbox.put_nowait(pack(msg))

    async def _send_loop(self) -> None:
        while True:
            data = await self._outbox.get()
            await self._to_engine.send(data)

    async def _output_loop(self) -> None:
        try:
            while not self.dead.is_set():
                if await self._from_engine.poll(POLL_MS):
                    while True:
                        try:
                            raw = self._from_engine.recv(zmq.NOBLOCK).result()
                        except zmq.Again:
                            break
                        self._handle(unpack(raw))
                elif self._proc.poll() is not None:
                    self._mark_dead(f"engine process exited with code {self._proc.returncode}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("engine output loop failed")
            self._mark_dead(f"engine output loop failed: {exc}")

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
        elif kind == "beam_done":
            fut = self._beams.get(msg["id"])
            if fut is not None and not fut.done():
                fut.set_result(decode_beam_output(msg["out"]))
        elif kind == "req_error":
            self._on_request_error(msg.get("id"), msg.get("msg", "invalid request"))
        elif kind == "fatal":
            logger.error("engine core reported a fatal error: %s", msg.get("msg"))
            self._mark_dead(f"engine core failed: {msg.get('msg')}")

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
        fut = self._pooling.get(child_id or "") or self._beams.get(child_id or "")
        if fut is not None and not fut.done():
            fut.set_exception(ValueError(message))
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
            [c.finish_reason or "abort" for c in ro.outputs], e2e, ro.metrics.queue_time)

    # ------------------------------------------------------------------ public API

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request now and return its stream of cumulative RequestOutputs.

        Invalid input raises ValueError (and a dead engine EngineDeadError) here, before any
        await, so a server can answer 400 before it starts a stream. Leaving the stream early
        or being cancelled aborts the request; call `abort` if the stream is never iterated.
        """
        if self.dead.is_set():
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.config.runner == "pooling":
            raise ValueError("this server runs a pooling model: use /v1/embeddings")
        prompt_ids, children = self.input_processor.process(request_id, prompt, params, priority)
        try:
            add_msg = pack({"t": "add", "reqs": [encode_request(c) for c in children]})
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"the request holds a value the engine cannot take: {exc}") from exc
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                  prompt_ids, params, children)
        stream = _RequestStream()
        self._streams[request_id] = stream
        for child in children:
            self._child_parent[child.request_id] = request_id
        self._outbox.put_nowait(add_msg)
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
        if self.dead.is_set():
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._beams or request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.input_processor.validate_prompt(prompt_ids, SamplingParams())
        fut = asyncio.get_running_loop().create_future()
        self._beams[request_id] = fut
        self._send({"t": "beam", "id": request_id, "prompt": list(prompt_ids),
                    "params": dataclasses.asdict(params), "priority": priority,
                    "eos": list(self.input_processor.eos_token_ids)})
        answered = False
        try:
            out = await fut
            answered = True
            return out
        finally:
            self._beams.pop(request_id, None)
            if not answered and not self.dead.is_set():
                self._send({"t": "abort", "ids": [request_id]})

    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent: a finished or unknown id is ignored).

        A reader still waiting on its stream gets RequestAbortedError."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(RequestAbortedError(f"request {request_id} was aborted"))
        self._abort_now(request_id)

    def _abort_now(self, request_id: str, record: bool = True) -> None:
        """Synchronous so it can run in a cancelled generator's `finally`."""
        child_ids = self.output_processor.abort(request_id)
        for cid in child_ids:
            self._child_parent.pop(cid, None)
            self._last_token_time.pop(cid, None)
        if child_ids and not self.dead.is_set():
            self._send({"t": "abort", "ids": child_ids})
        if child_ids and record and self.stat_logger is not None:
            self.stat_logger.on_request_finished(["abort"] * len(child_ids), None, None)

    async def get_stats(self, fresh: bool = False, timeout_s: float = 2.0) -> dict[str, Any]:
        """Latest engine stats; `fresh` asks the engine for a snapshot taken after this call."""
        if not fresh or self.dead.is_set():
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


def _stop_process(proc: subprocess.Popen) -> None:
    """Close stdin (the engine exits on EOF), then terminate and kill if it lingers."""
    with contextlib.suppress(Exception):
        proc.stdin.close()
    for action in (None, proc.terminate, proc.kill):
        if action is not None and proc.poll() is None:
            action()
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue
