"""/score and /rerank (vLLM's shapes): relevance of text pairs from a pooling model.

A one-label cross-encoder (`*ForSequenceClassification`) reads each pair as one input (the
tokenizer's pair encoding; BERT's second segment gets token type 1) and its sigmoid is the
score. An embedding model scores by the cosine similarity of the two texts' vectors.

- `/score` (also `/v1/score`): `text_1` (one text, or N) and `text_2` (N texts); one text_1
  goes with every text_2. Answers `data: [{"index", "object": "score", "score"}]`.
- `/rerank` (also `/v1/rerank`): `query` and `documents`; answers `results` sorted by
  `relevance_score`, best first, each with its `index` in `documents` and the `document`, the
  first `top_n` of them (0: all).
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from slipstream.models.bert import num_labels
from slipstream.pooling.config import is_classifier_architecture
from slipstream.pooling.offline import activation
from slipstream.pooling.pairs import pair_pooling_params
from slipstream.serve.context import ServeContext, to_api_error
from slipstream.serve.errors import APIError
from slipstream.serve.protocol import StrictModel, UsageInfo, _check_text, random_id
from slipstream.serve.streaming import gather_or_cancel, run_until_disconnect

_NO_OPTIONS = {"dimensions": None, "normalize": None}


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0

    _utf8 = field_validator("text_1", "text_2")(_check_text)


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    priority: int = 0

    _utf8 = field_validator("query", "documents")(_check_text)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: UsageInfo
    results: list[RerankResult]


def _pairs(
    text_1: str | list[str], text_2: str | list[str], ctx: ServeContext, params: tuple[str, str]
) -> list[tuple[str, str]]:
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not right:
        raise APIError(f"{params[1]} must not be empty", param=params[1])
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError(
            f"give one {params[0]} or as many as {params[1]} ({len(right)}), got {len(left)}", param=params[0]
        )
    if len(right) > ctx.limits.max_prompts:
        raise APIError(
            f"at most {ctx.limits.max_prompts} pairs per request, got {len(right)}", param=params[1]
        )
    return list(zip(left, right))


def _scoring_kind(ctx: ServeContext) -> str:
    """ "cross" (a one-label classifier) or "embed"; a 400 for a model that cannot score."""
    config = getattr(ctx.engine, "config", None)
    if config is None or config.runner != "pooling":
        raise APIError(
            "this model does not score text pairs: start the server with a "
            "cross-encoder or an embedding model",
            param="model",
        )
    if not is_classifier_architecture(config.model.architecture):
        return "embed"
    if num_labels(config.model.hf_config) != 1:
        raise APIError(
            "this classifier has several labels; scoring needs a one-label cross-encoder", param="model"
        )
    return "cross"


def _checked(ctx: ServeContext, prompts_and_starts: list, param: str) -> list:
    out = []
    for ids, start in prompts_and_starts:
        ctx.check_token_ids(ids, param)
        if len(ids) >= ctx.limits.max_model_len:
            raise APIError(
                f"a pair has {len(ids)} tokens; this model takes at most {ctx.limits.max_model_len - 1}",
                param=param,
                code="context_length_exceeded",
            )
        out.append((ids, start))
    return out


async def score_pairs(
    ctx: ServeContext, pairs: list[tuple[str, str]], request_id: str, param: str
) -> tuple[list[float], int]:
    """(score per pair, prompt tokens) on the engine, the pairs batched together."""
    if ctx.prompts is None:
        raise APIError("this model has no tokenizer: scoring takes text", param=param)
    kind = _scoring_kind(ctx)
    if kind == "cross":
        encoded = [await ctx.prompts.encode_pair(a, b, param) for a, b in pairs]
    else:
        encoded = [(await ctx.encode(t), None) for pair in pairs for t in pair]
    inputs = _checked(ctx, encoded, param)
    jobs = [
        ctx.engine.encode(ids, pair_pooling_params(_NO_OPTIONS, start), f"{request_id}-{i}")
        for i, (ids, start) in enumerate(inputs)
    ]
    try:
        vectors = await gather_or_cancel(jobs)
    except Exception as exc:  # noqa: BLE001 - engine death, a bad request
        raise to_api_error(exc) from exc
    num_tokens = sum(len(ids) for ids, _ in inputs)
    if kind == "cross":
        return [activation(v)[0] for v in vectors], num_tokens
    scores = [sum(x * y for x, y in zip(a, b)) for a, b in zip(vectors[0::2], vectors[1::2])]
    return scores, num_tokens


async def create_score(req: ScoreRequest, raw_request: Request, ctx: ServeContext) -> Response:
    ctx.check_model(req.model)
    pairs = _pairs(req.text_1, req.text_2, ctx, ("text_1", "text_2"))
    request_id = random_id("score")

    async def run() -> Response:
        scores, num_tokens = await score_pairs(ctx, pairs, request_id, "text_2")
        body = ScoreResponse(
            id=request_id,
            model=ctx.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(body.model_dump(mode="json"))

    return await run_until_disconnect(raw_request, run())


async def create_rerank(req: RerankRequest, raw_request: Request, ctx: ServeContext) -> Response:
    ctx.check_model(req.model)
    pairs = _pairs(req.query, req.documents, ctx, ("query", "documents"))
    request_id = random_id("rerank")

    async def run() -> Response:
        scores, num_tokens = await score_pairs(ctx, pairs, request_id, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        body = RerankResponse(
            id=request_id,
            model=ctx.model_name,
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
            results=[
                RerankResult(
                    index=i, document=RerankDocument(text=req.documents[i]), relevance_score=scores[i]
                )
                for i in order
            ],
        )
        return JSONResponse(body.model_dump(mode="json"))

    return await run_until_disconnect(raw_request, run())
