"""API-key check as a plain ASGI middleware: every route but /health needs the key when one is set.

The key is compared with hmac.compare_digest so the time taken does not leak how much matched.
"""
from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from slipstream.serve.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_json(send, 401, error_body(
            "missing or invalid API key: send 'Authorization: Bearer <key>'", 401,
            code="invalid_api_key"), [(b"www-authenticate", b'Bearer realm="slipstream"')])

    def _authorized(self, scope: Scope) -> bool:
        supplied = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    supplied = token.strip()
        # compare_digest on two bytes objects: constant time in the length of the key.
        return hmac.compare_digest(supplied, self._key)


async def send_json(send: Send, status: int, body: dict,
                    extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())] + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
