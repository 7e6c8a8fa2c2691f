"""Disconnect-aware responses: a client that goes away cancels its work, which aborts its requests.

`SSEResponse` streams server-sent events while listening for http.disconnect; `run_until_disconnect`
does the same for a plain JSON handler. `merge_streams` interleaves several request streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("slipstream.serve")
T = TypeVar("T")


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_and_wait(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


class SSEResponse(StreamingResponse):
    """text/event-stream body from an async iterator of str; stops producing on disconnect.

    Unlike Starlette's own, it always listens for the disconnect (whatever the ASGI spec
    version), so a client that leaves while the engine is still queueing is noticed at once.
    """

    def __init__(self, body: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.create_task(self._produce(send))
        listener = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_and_wait(listener)
            if not producer.done():
                await _cancel_and_wait(producer)
            with contextlib.suppress(Exception):
                await self._body.aclose()  # type: ignore[attr-defined]
            if self._on_close is not None:
                await self._on_close()

    async def _produce(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self._body:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return  # the client went away mid-write


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T | Response:
    """Run a handler's work, cancelling it if the client disconnects first."""
    task = asyncio.create_task(work)
    listener = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel_and_wait(task)
        raise
    finally:
        await _cancel_and_wait(listener)
    if not task.done():
        await _cancel_and_wait(task)
        return Response(status_code=499)  # nobody is listening; the status is for the log
    return task.result()


async def gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """asyncio.gather, but the first failure (or our cancellation) cancels the rest."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                await _cancel_and_wait(t)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield (stream index, item) as items arrive from any stream; re-raise the first error."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None, False))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, None, exc, True))
            return
        queue.put_nowait((index, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for t in tasks:
            if not t.done():
                await _cancel_and_wait(t)
