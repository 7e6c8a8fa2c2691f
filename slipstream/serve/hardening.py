"""What the HTTP layer does against slow, numerous or malformed clients, where uvicorn does not.

- `hardened_h11(limits)`: uvicorn's h11 protocol with a deadline on reading a request's headers
  (408, then close), a cap on open connections (each connection over it gets 429 and is closed
  after its first request) and an OpenAI error body for the 400 that uvicorn sends for a
  malformed request or oversized headers (uvicorn's own is plain text).
- `RequestCapMiddleware`: a cap on requests being served at once (429 with Retry-After).
- The body read timeout lives in `limits.BodySizeLimitMiddleware`, which already wraps reads.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from slipstream.serve.auth import send_json
from slipstream.serve.errors import error_body

UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})  # probes must answer under any load
RETRY_AFTER_S = 1
LINGER_S = 2.0  # after a 400 for a malformed request: how long to drop further input
LINGER_BYTES = 8 * 2**20  # ... and how much of it


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # to receive a request line and all headers
    body_timeout_s: float = 10.0  # between two reads of a body that is not complete
    max_connections: int = 1000  # open connections; more get 429 and are closed
    max_concurrent_requests: int = 512  # requests being served; more get 429


def _raw_error(status: int, reason: str, body: dict, extra: str = "") -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + payload


async def too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(
        send,
        429,
        error_body("too many open connections; retry shortly", 429, code="too_many_connections"),
        [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")],
    )


def hardened_h11(limits: HttpLimits) -> type[H11Protocol]:
    """An H11Protocol subclass bound to `limits` (pass it as uvicorn.Config(http=...))."""

    class HardenedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _seen_cycle: object = None
        _lingering: int | None = None  # bytes still to drop before closing, once answered

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = too_many_connections  # this connection only
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.cycle is not self._seen_cycle:
                self._seen_cycle = self.cycle  # headers of a new request are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers are on the clock too
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(
                error_body(
                    "invalid HTTP request: malformed, or its headers are too large",
                    400,
                    code="invalid_http_request",
                )
            ).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"content-length", str(len(body)).encode()),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self._linger()

        def _linger(self) -> None:
            """Close after reading (and dropping) what the client is still sending: closing
            with unread input makes the kernel reset the connection, and the client would
            never read the answer."""
            self._disarm_header_timer()
            self._lingering = LINGER_BYTES
            self.loop.call_later(LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._lingering is None:
                super().data_received(data)
                return
            self._lingering -= len(data)
            if self._lingering < 0:
                self.transport.close()

        def eof_received(self) -> bool | None:
            if self._lingering is not None:
                self.transport.close()
            return super().eof_received()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            busy = self.cycle is not None and not self.cycle.response_complete
            if busy:
                return
            self.transport.write(
                _raw_error(
                    408,
                    "Request Timeout",
                    error_body(
                        f"request headers not received within {limits.header_timeout_s:g} s",
                        408,
                        code="timeout",
                    ),
                )
            )
            self.transport.close()

    return HardenedH11Protocol


class RequestCapMiddleware:
    """At most `max_requests` requests served at once (a stream counts until it ends)."""

    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests:
            await send_json(
                send,
                429,
                error_body(
                    f"the server is serving its limit of {self.max_requests} requests; retry shortly",
                    429,
                    code="too_many_requests",
                ),
                [(b"retry-after", str(RETRY_AFTER_S).encode())],
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
