"""/v1/completions: one or more prompts (text or token ids), streamed or not, with echo/logprobs.

A batch of prompts becomes one engine request per prompt; choice i of prompt p has index
p * n + i, as in the OpenAI API.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from slipstream.engine.async_llm import EngineDeadError
from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.sampling_params import SamplingParams
from slipstream.serve.context import (
    ServeContext,
    last_output,
    start_generation,
    stream_error_event,
    to_api_error,
)
from slipstream.serve.errors import APIError
from slipstream.serve.formatting import (
    SSE_DONE,
    ChoiceCursor,
    TokenText,
    completion_logprobs,
    public_reason,
    sse,
    usage_of,
)
from slipstream.serve.params import check_common, completion_params
from slipstream.serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from slipstream.serve.streaming import (
    SSEResponse,
    gather_or_cancel,
    merge_streams,
    run_until_disconnect,
)


async def _prompts(req: CompletionRequest,
                   ctx: ServeContext) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) per prompt; checks count, emptiness and token ranges."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        items: list = [raw]
    else:
        items = list(raw)
    if not items:
        raise APIError("prompt must not be empty", param="prompt")
    if len(items) > ctx.limits.max_prompts:
        raise APIError(f"at most {ctx.limits.max_prompts} prompts per request, got {len(items)}",
                       param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = await ctx.encode(item) if item else []
            text = item
        else:
            ids = list(item)
            ctx.check_token_ids(ids, "prompt")
            text = ctx.decode(ids) if req.echo else ""
        if not ids:
            raise APIError("prompt is empty: give at least one token", param="prompt")
        out.append((text, ids))
    return out


def _check_request(req: CompletionRequest, ctx: ServeContext) -> None:
    ctx.check_model(req.model)
    check_common(req, ctx.limits)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported unless it equals n", param="best_of")


async def create_completion(req: CompletionRequest, raw_request: Request,
                            ctx: ServeContext) -> Response:
    if req.use_beam_search:
        from slipstream.serve.beam_search import create_beam_completion

        return await create_beam_completion(req, raw_request, ctx, _prompts)
    _check_request(req, ctx)
    prompts = await _prompts(req, ctx)
    params = [completion_params(req, len(ids), ctx.limits) for _, ids in prompts]
    if ctx.tokenizer is None and params[0].stop:
        raise APIError("stop strings need a tokenizer; this model has none", param="stop")
    request_id = random_id("cmpl")
    sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = []

    async def abort_all() -> None:
        for sid in sub_ids:
            await ctx.engine.abort(sid)

    try:
        for sid, (_, ids), p in zip(sub_ids, prompts, params):
            streams.append(start_generation(ctx, ids, p, sid, req.priority,
                                            ctx.lora_for(req.model)))
    except APIError:
        await abort_all()
        raise
    job = _CompletionJob(req, ctx, request_id, prompts, params)
    if req.stream:
        return SSEResponse(job.stream(streams), on_close=abort_all)
    try:
        return await run_until_disconnect(raw_request, job.full(streams))
    finally:
        await abort_all()


class _CompletionJob:
    def __init__(self, req: CompletionRequest, ctx: ServeContext, request_id: str,
                 prompts: list[tuple[str, list[int]]], params: list[SamplingParams]) -> None:
        self.req = req
        self.ctx = ctx
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.token_text = TokenText(ctx.tokenizer)
        self.model_name = ctx.response_model(req.model)

    async def full(self, streams: list[AsyncIterator[RequestOutput]]) -> Response:
        try:
            finals = await gather_or_cancel([last_output(s) for s in streams])
        except (EngineDeadError, ValueError, RuntimeError) as exc:
            raise to_api_error(exc) from exc
        choices = []
        for p_idx, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(self._choice(p_idx, out, c))
        body = CompletionResponse(id=self.request_id, model=self.model_name,
                                  choices=choices, usage=usage_of(finals))
        return JSONResponse(body.model_dump(mode="json"))

    def _choice(self, p_idx: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        prompt_text, prompt_ids = self.prompts[p_idx]
        text = (prompt_text if self.req.echo else "") + c.text
        logprobs = None
        if self.req.logprobs is not None:
            ids, lps, offset = list(c.token_ids), list(c.logprobs or []), 0
            if self.req.echo:
                ids = prompt_ids + ids
                lps = self._prompt_logprobs(out) + lps
            logprobs = completion_logprobs(self.token_text, ids, lps, self.req.logprobs, offset)
        return CompletionChoice(index=p_idx * self.req.n + c.index, text=text, logprobs=logprobs,
                                finish_reason=public_reason(c.finish_reason),
                                stop_reason=c.stop_reason)

    def _prompt_logprobs(self, out: RequestOutput) -> list:
        plp = list(out.prompt_logprobs or [])
        missing = len(out.prompt_token_ids) - len(plp)
        return [None] * missing + plp if missing > 0 else plp[: len(out.prompt_token_ids)]

    async def stream(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        cursors: dict[int, ChoiceCursor] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for p_idx, out in merge_streams(streams):
                finals[p_idx] = out
                for c in out.outputs:
                    chunk = self._chunk(p_idx, out, c, cursors)
                    if chunk is not None:
                        yield sse(chunk)
            if include_usage:
                usage = usage_of(list(finals.values()))
                yield sse(CompletionResponse(id=self.request_id, model=self.model_name,
                                             choices=[], usage=usage).model_dump_json())
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            yield sse(stream_error_event(exc))
        yield SSE_DONE

    def _chunk(self, p_idx: int, out: RequestOutput, c: CompletionOutput,
               cursors: dict[int, ChoiceCursor]) -> str | None:
        index = p_idx * self.req.n + c.index
        cursor = cursors.setdefault(index, ChoiceCursor())
        delta = cursor.advance(c, self.params[p_idx].stop)
        if delta is None:
            return None
        text = delta.text
        logprobs = None
        if self.req.logprobs is not None:
            ids, lps = delta.token_ids, list(delta.logprobs or [])
            if delta.first and self.req.echo:
                ids = self.prompts[p_idx][1] + ids
                lps = self._prompt_logprobs(out) + lps
            logprobs = completion_logprobs(self.token_text, ids, lps, self.req.logprobs, 0)
        if delta.first and self.req.echo:
            text = self.prompts[p_idx][0] + text
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason,
                                  stop_reason=delta.stop_reason if delta.finish_reason else None)
        return CompletionResponse(id=self.request_id, model=self.model_name,
                                  choices=[choice]).model_dump_json()
