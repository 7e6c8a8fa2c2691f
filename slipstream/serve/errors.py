"""OpenAI-style error bodies and the exception handlers that produce them.

Every client mistake becomes a 4xx with {"error": {"message", "type", "param", "code"}}; anything
unexpected becomes a 500 with a generic message while the details go to the log.
"""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("slipstream.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(message: str, status: int, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams / input-processor errors start with the field name: reuse it as param."""
    msg = str(exc) or "invalid request"
    match = re.match(r"([a-z_]+)(?::| must| is)", msg)
    return APIError(msg, 400, param=match.group(1) if match else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members show up as loc parts like "str" / "list[int]": keep the field path only.
    loc = [p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool", p)]
    if first.get("type") in ("json_invalid", "value_error.jsondecode"):
        return "request body is not valid JSON", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error(s))"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        response = error_response(exc.message, exc.status, exc.param, exc.code)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(msg, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        code = {404: "not_found", 408: "timeout", 413: "request_too_large"}.get(status)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if status == 400 and "parsing the body" in detail:
            detail = "request body is not valid JSON"
        response = error_response(detail, status, None, code)
        if status in (408, 413):  # the rest of the body may never come: do not wait for it
            response.headers["connection"] = "close"
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request", exc_info=exc)
        return error_response("internal server error", 500)
