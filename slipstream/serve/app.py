"""The FastAPI app: OpenAI-compatible routes plus health, version, metrics and tokenizer helpers.

`build_app` wires an engine client (AsyncLLM, or a fake in tests) into the routes; the server
process (`serve.cli.run_serve`) owns the engine's lifetime.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slipstream import __version__
from slipstream.serve.auth import OPEN_PATHS, ApiKeyMiddleware
from slipstream.serve.chat import create_chat_completion, render_chat
from slipstream.serve.completions import create_completion
from slipstream.serve.context import EngineClient, ServeContext
from slipstream.serve.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from slipstream.serve.errors import APIError, error_response, install_error_handlers
from slipstream.serve.hardening import UNCOUNTED_PATHS, HttpLimits, RequestCapMiddleware
from slipstream.serve.limits import BodySizeLimitMiddleware
from slipstream.serve.lora import add_lora_routes
from slipstream.serve.metrics import CONTENT_TYPE, ServerMetrics
from slipstream.serve.params import ServeLimits
from slipstream.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from slipstream.serve.scoring import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    create_rerank,
    create_score,
)
from slipstream.serve.tool_parsers import get_tool_parser

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)
}
_SSE_200: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response, or with `stream: true` a text/event-stream of "
                         "`data: <chunk JSON>` events ending with `data: [DONE]`.",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
}


def build_app(engine: EngineClient, tokenizer: Any, model_name: str, limits: ServeLimits,
              api_key: str | None = None, metrics: ServerMetrics | None = None,
              http_limits: HttpLimits | None = None,
              tool_call_parser: str = "hermes", loras: Any = None) -> FastAPI:
    """loras: a serve/lora.LoRARegistry when the engine serves LoRA adapters."""
    app = FastAPI(title="slipstream", version=__version__,
                  description="OpenAI-compatible API of the slipstream inference engine.")
    ctx = ServeContext(engine, tokenizer, model_name, limits, metrics,
                       get_tool_parser(tool_call_parser), loras)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    add_lora_routes(app, loras)
    http_limits = http_limits or HttpLimits()
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_bytes,
                       timeout_s=http_limits.body_timeout_s)
    app.add_middleware(RequestCapMiddleware, max_requests=http_limits.max_concurrent_requests)
    if api_key:  # added last = outermost: reject before reading the body
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.openapi = lambda: _openapi(app, limits, bool(api_key))  # type: ignore[method-assign]
    return app


def _add_generation_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, **_SSE_200})
    async def completions(req: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(req, raw_request, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, **_SSE_200})
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(req, raw_request, ctx)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, raw_request: Request) -> Response:
        return await create_embedding(req, raw_request, ctx)

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=_ERRORS)
        async def score(req: ScoreRequest, raw_request: Request) -> Response:
            return await create_score(req, raw_request, ctx)

    for path in ("/rerank", "/v1/rerank"):
        @app.post(path, response_model=RerankResponse, responses=_ERRORS)
        async def rerank(req: RerankRequest, raw_request: Request) -> Response:
            return await create_rerank(req, raw_request, ctx)


def _add_info_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        names = [ctx.model_name, *(ctx.loras.names if ctx.loras is not None else [])]
        return ModelList(data=[ModelCard(id=name, max_model_len=ctx.limits.max_model_len)
                               for name in names])

    @app.get("/health", response_model=HealthResponse,
             responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not ctx.engine.is_running:
            return error_response("the engine is not running (restarting, or dead)", 503,
                                  code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        if ctx.metrics is None:
            raise APIError("metrics are disabled", 404, code="not_found")
        if ctx.engine.is_running:
            await ctx.engine.get_stats(fresh=True)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def _add_tokenizer_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError("messages must not be empty", param="messages")
            ids = await render_chat(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = await ctx.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=ctx.limits.max_model_len,
                                tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        if len(req.tokens) > ctx.limits.max_model_len * 4:
            raise APIError("too many tokens", param="tokens")
        ctx.check_token_ids(req.tokens, "tokens")
        if ctx.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))


def _openapi(app: FastAPI, limits: ServeLimits, auth: bool) -> dict[str, Any]:
    """The schema of what this server really does: 400 (not FastAPI's 422) for a bad body, the
    4xx its HTTP layer answers on every route, and the server's caps as bounds."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            _document_errors(op, path, auth)
    _apply_limits(schema.get("components", {}).get("schemas", {}), limits)
    app.openapi_schema = schema
    return schema


def _error_ref(description: str, headers: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "string"}}}


def _document_errors(op: dict[str, Any], path: str, auth: bool) -> None:
    responses = op.setdefault("responses", {})
    if "422" in responses:
        responses.pop("422")
        responses.setdefault("400", _error_ref("Bad Request"))
    if "requestBody" in op:
        responses.setdefault("400", _error_ref("Bad Request"))
        responses.setdefault("408", _error_ref("The body was not received in time"))
        responses.setdefault("413", _error_ref("The body is larger than the server's limit"))
    if auth and path not in OPEN_PATHS:
        responses.setdefault("401", _error_ref("Missing or wrong API key", {
            "WWW-Authenticate": {"schema": {"type": "string"}}}))
    if path not in UNCOUNTED_PATHS:
        responses.setdefault("429", _error_ref("Too many requests or connections",
                                               _RETRY_AFTER))
    if path.startswith("/v1/c"):
        responses.setdefault("503", _error_ref("The engine is restarting or dead"))
        responses.setdefault("504", _error_ref("The request timed out"))


def _apply_limits(schemas: dict[str, Any], limits: ServeLimits) -> None:
    """The caps that produce a 400, written into the request schemas as maxima."""
    caps = {"n": limits.max_n, "logprobs": limits.max_logprobs,
            "top_logprobs": limits.max_logprobs,
            "max_tokens": limits.max_tokens or limits.max_model_len - 1,
            "max_completion_tokens": limits.max_tokens or limits.max_model_len - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field, cap in caps.items():
            if field in props:
                _set_maximum(props[field], cap)


def _set_maximum(prop: dict[str, Any], cap: int) -> None:
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = min(cap, option.get("maximum", cap))
