"""/v1/completions with `use_beam_search` (vLLM's fields): best_of (else n) beams per prompt,
the n best hypotheses returned as choices, best first. Sampling fields that beam search cannot
honour are a 400 naming them.

Streaming (`stream: true`): until the search ends, no one knows which hypothesis wins, but the
tokens every live hypothesis begins with are settled (engine/beam.py). Those stream as they
settle, the same text to each of the prompt's n choices. When the search ends, each choice gets
the rest of its own hypothesis and its finish_reason. Both forms build the text the same way
(`_BeamText`: the settled tokens, then each hypothesis's rest, through one incremental
detokenizer), so a choice's streamed deltas join to exactly its non-streamed text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from slipstream.sampling.beam_search import BeamSearchParams, BeamSearchUpdate, BeamSequence
from slipstream.sampling_params import SamplingParams
from slipstream.serve.context import ServeContext, stream_error_event, to_api_error
from slipstream.serve.errors import APIError
from slipstream.serve.formatting import SSE_DONE, sse
from slipstream.serve.params import check_common, resolve_max_tokens
from slipstream.serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from slipstream.serve.streaming import SSEResponse, merge_streams, run_until_disconnect
from slipstream.tokenizer.detokenizer import IncrementalDetokenizer

# Fields whose non-default values beam search does not take.
_UNSUPPORTED = {
    "logprobs": None,
    "suffix": None,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "top_p": None,
    "top_k": None,
    "min_p": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "repetition_penalty": None,
    "min_tokens": 0,
}


def beam_params(req: CompletionRequest, prompt_len: int, ctx: ServeContext) -> BeamSearchParams:
    for name, default in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value != default and value not in ([], ""):
            raise APIError(f"{name} is not supported with use_beam_search", param=name)
    if req.temperature not in (None, 0.0):
        raise APIError("use_beam_search takes temperature 0 (or unset)", param="temperature")
    width = req.best_of if req.best_of is not None else req.n
    if req.n > width:
        raise APIError(f"n ({req.n}) must be at most best_of ({width}), the beam width", param="best_of")
    max_tokens = resolve_max_tokens(req.max_tokens, prompt_len, ctx.limits)
    try:
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            length_penalty=req.length_penalty,
        )
    except ValueError as exc:
        raise APIError(str(exc), param="best_of" if "beam_width" in str(exc) else None) from exc


class _BeamText:
    """The text of one prompt's choices: the settled tokens once, then each returned
    hypothesis's rest, on a fork of the same detokenizer."""

    def __init__(self, ctx: ServeContext, prompt_ids: list[int], skip_special: bool) -> None:
        self._shared = None
        if ctx.tokenizer is not None:
            params = SamplingParams(max_tokens=None, skip_special_tokens=skip_special)
            self._shared = IncrementalDetokenizer(ctx.tokenizer, prompt_ids, params)
        self.num_settled = 0

    def settle(self, token_ids: list[int]) -> str:
        """Text of newly settled tokens (shared by every choice)."""
        self.num_settled += len(token_ids)
        return self._shared.update(token_ids) if self._shared is not None else ""

    def rest(self, seq: BeamSequence) -> str:
        """The text of a returned hypothesis after the settled tokens."""
        if self._shared is None:
            return ""
        own = self._shared.fork()
        return own.update(seq.output_token_ids[self.num_settled :]) + own.finalize()


class _BeamJob:
    def __init__(
        self,
        req: CompletionRequest,
        ctx: ServeContext,
        request_id: str,
        prompts: list[tuple[str, list[int]]],
        params: list[BeamSearchParams],
    ) -> None:
        self.req = req
        self.ctx = ctx
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.search_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.texts = [_BeamText(ctx, ids, req.skip_special_tokens) for _, ids in prompts]
        self.completion_tokens = 0

    def searches(self) -> list[AsyncIterator[BeamSearchUpdate]]:
        return [
            self.ctx.engine.beam_search_stream(ids, p, sid, self.req.priority)
            for sid, (_, ids), p in zip(self.search_ids, self.prompts, self.params)
        ]

    async def abort_all(self) -> None:
        for sid in self.search_ids:
            await self.ctx.engine.abort(sid)

    def pieces(self, p_idx: int, update: BeamSearchUpdate) -> list[CompletionChoice]:
        """The choices' new text for one update of prompt p_idx's search."""
        n, text = self.req.n, self.texts[p_idx]
        if update.output is None:
            delta = text.settle(update.settled_token_ids)
            return [CompletionChoice(index=p_idx * n + i, text=delta) for i in range(n)]
        choices = []
        for i, seq in enumerate(update.output.sequences[:n]):
            self.completion_tokens += len(seq.output_token_ids)
            choices.append(
                CompletionChoice(index=p_idx * n + i, text=text.rest(seq), finish_reason=seq.finish_reason)
            )
        return choices

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt_tokens + self.completion_tokens,
        )

    async def updates(self) -> AsyncIterator[tuple[int, BeamSearchUpdate]]:
        searches = self.searches()
        async with contextlib.AsyncExitStack() as stack:
            for search in searches:
                await stack.enter_async_context(contextlib.aclosing(search))
            async for p_idx, update in merge_streams(searches):
                yield p_idx, update

    async def full(self) -> Response:
        texts: dict[int, CompletionChoice] = {}
        try:
            async for p_idx, update in self.updates():
                for piece in self.pieces(p_idx, update):
                    choice = texts.setdefault(piece.index, CompletionChoice(index=piece.index, text=""))
                    choice.text += piece.text
                    choice.finish_reason = piece.finish_reason or choice.finish_reason
        except Exception as exc:  # noqa: BLE001 - engine death, a bad request
            raise to_api_error(exc) from exc
        choices = [c for _, c in sorted(texts.items()) if c.finish_reason is not None]
        if self.req.echo:
            for c in choices:
                c.text = self.prompts[c.index // self.req.n][0] + c.text
        body = CompletionResponse(
            id=self.request_id, model=self.ctx.model_name, choices=choices, usage=self.usage()
        )
        return JSONResponse(body.model_dump(mode="json"))

    async def stream(self) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        started: set[int] = set()
        try:
            async for p_idx, update in self.updates():
                for piece in self.pieces(p_idx, update):
                    if piece.index not in started:
                        started.add(piece.index)
                        if self.req.echo:
                            piece.text = self.prompts[p_idx][0] + piece.text
                    elif not piece.text and piece.finish_reason is None:
                        continue
                    yield sse(self._chunk([piece]))
            if include_usage:
                yield sse(self._chunk([], self.usage()))
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            yield sse(stream_error_event(exc))
        yield SSE_DONE

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return CompletionResponse(
            id=self.request_id, model=self.ctx.model_name, choices=choices, usage=usage
        ).model_dump_json()


async def create_beam_completion(
    req: CompletionRequest, raw_request: Request, ctx: ServeContext, prompts_of: Callable
) -> Response:
    ctx.check_model(req.model)
    check_common(req, ctx.limits)
    prompts = await prompts_of(req, ctx)
    params = [beam_params(req, len(ids), ctx) for _, ids in prompts]
    job = _BeamJob(req, ctx, random_id("cmpl"), prompts, params)
    if req.stream:
        return SSEResponse(job.stream(), on_close=job.abort_all)
    try:
        return await run_until_disconnect(raw_request, job.full())
    finally:
        await job.abort_all()
