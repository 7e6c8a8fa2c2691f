"""The FastAPI app: OpenAI-compatible routes plus health, version, metrics and tokenizer helpers.

`build_app` wires an engine client (AsyncLLM, or a fake in tests) into the routes; the server
process (`serve.cli.run_serve`) owns the engine's lifetime.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from slipstream import __version__
from slipstream.serve.auth import ApiKeyMiddleware
from slipstream.serve.chat import create_chat_completion, render_chat
from slipstream.serve.completions import create_completion
from slipstream.serve.context import EngineClient, ServeContext
from slipstream.serve.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from slipstream.serve.errors import APIError, error_response, install_error_handlers
from slipstream.serve.limits import BodySizeLimitMiddleware
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
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)
}


def build_app(engine: EngineClient, tokenizer: Any, model_name: str, limits: ServeLimits,
              api_key: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(title="slipstream", version=__version__,
                  description="OpenAI-compatible API of the slipstream inference engine.")
    ctx = ServeContext(engine, tokenizer, model_name, limits, metrics)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_bytes)
    if api_key:  # added last = outermost: reject before reading the body
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.openapi = lambda: _openapi_400(app)  # type: ignore[method-assign]
    return app


def _add_generation_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(req: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(req, raw_request, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(req, raw_request, ctx)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, raw_request: Request) -> Response:
        return await create_embedding(req, raw_request, ctx)


def _add_info_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name,
                                         max_model_len=ctx.limits.max_model_len)])

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not ctx.engine.is_running:
            return error_response("the engine is not running", 503, code="engine_dead")
        return Response(status_code=200)

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
            ids = render_chat(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = ctx.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
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


def _openapi_400(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents validation errors as 422; this server answers 400 (OpenAI)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            if "422" in responses:
                responses.pop("422")
                responses.setdefault("400", {
                    "description": "Bad Request",
                    "content": {"application/json": {"schema": {
                        "$ref": "#/components/schemas/ErrorResponse"}}}})
    app.openapi_schema = schema
    return schema

