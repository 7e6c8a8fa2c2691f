"""Request body size cap and read timeout as a plain ASGI middleware (413 / 408 with an OpenAI
error body).

Checks the Content-Length header up front and counts bytes as they arrive, so a chunked upload
cannot get around the cap either. While the body is incomplete, each read must bring data within
`timeout_s`: a client that announces more than it sends is cut off instead of holding a worker.
"""
from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slipstream.serve.auth import send_json
from slipstream.serve.errors import error_body

DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # past this, just close the connection on the sender


class _BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI's body parser re-raises it instead of turning it into a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large_message(max_bytes))


class _BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"request body not received within {timeout_s:g} s")


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= DRAIN_LIMIT_BYTES:
                await _drain(receive, declared)
            await self._reject(send)
            return
        received = 0
        started = False
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done or self.timeout_s is None:
                message = await receive()  # after the body: a disconnect listener, no deadline
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.timeout_s)
                except TimeoutError:
                    raise _BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_LIMIT_BYTES - received)
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)
        except _BodyTimeout as exc:
            if not started:
                await send_json(send, 408, error_body(exc.detail, 408, code="timeout"),
                                [(b"connection", b"close")])

    async def _reject(self, send: Send) -> None:
        msg = _too_large_message(self.max_bytes)
        await send_json(send, 413, error_body(msg, 413, code="request_too_large"),
                        [(b"connection", b"close")])


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of the body first: closing a socket with unread input makes the
    kernel send a reset, and the client would never see our 413."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large_message(max_bytes: int) -> str:
    return f"request body is larger than the server's limit of {max_bytes} bytes"
