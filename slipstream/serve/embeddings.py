"""/v1/embeddings: OpenAI request and response shapes, float or base64 vectors.

Each input becomes one pooling request (the engine batches them); `dimensions` truncates a
Matryoshka model's vector before it is normalised. base64 is the little-endian float32 bytes
of the vector, as the OpenAI API sends it.
"""
from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from slipstream.pooling.config import is_classifier_architecture
from slipstream.pooling.pooler import check_pooling_params
from slipstream.serve.context import ServeContext, to_api_error
from slipstream.serve.errors import APIError
from slipstream.serve.protocol import StrictModel, UsageInfo, _check_text, random_id
from slipstream.serve.streaming import gather_or_cancel, run_until_disconnect


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    _utf8_input = field_validator("input", "user")(_check_text)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


async def _inputs(req: EmbeddingRequest, ctx: ServeContext) -> list[list[int]]:
    raw = req.input
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise APIError("input must not be empty", param="input")
    if len(items) > ctx.limits.max_prompts:
        raise APIError(f"at most {ctx.limits.max_prompts} inputs per request, got {len(items)}",
                       param="input")
    out = []
    for item in items:
        ids = await ctx.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError("input is empty: give at least one token", param="input")
        ctx.check_token_ids(ids, "input")
        if len(ids) >= ctx.limits.max_model_len:
            raise APIError(f"input has {len(ids)} tokens; this model takes at most "
                           f"{ctx.limits.max_model_len - 1}", param="input")
        out.append(ids)
    return out


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(req: EmbeddingRequest, raw_request: Request,
                           ctx: ServeContext) -> Response:
    ctx.check_model(req.model)
    config = getattr(ctx.engine, "config", None)
    if config is None or config.runner != "pooling" or is_classifier_architecture(
            config.model.architecture):
        raise APIError("this model does not serve embeddings: start the server with an "
                       "embedding model or --runner pooling", param="model")
    params = {"dimensions": req.dimensions, "normalize": None}
    try:
        check_pooling_params(params, config.pooler, config.model.hidden_size, False)
    except ValueError as exc:
        raise APIError(str(exc), param="dimensions") from exc
    prompts = await _inputs(req, ctx)
    request_id = random_id("embd")

    async def run() -> Response:
        jobs = [ctx.engine.encode(ids, params, f"{request_id}-{i}")
                for i, ids in enumerate(prompts)]
        try:
            vectors = await gather_or_cancel(jobs)
        except Exception as exc:  # noqa: BLE001 - engine death, a bad request
            raise to_api_error(exc) from exc
        num_tokens = sum(len(ids) for ids in prompts)
        body = EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=_encode_vector(v, req.encoding_format))
                  for i, v in enumerate(vectors)],
            model=ctx.model_name,
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(body.model_dump(mode="json"))

    return await run_until_disconnect(raw_request, run())
