"""/v1/chat/completions: render the chat template, generate, answer as a message or a stream.

Streams follow the OpenAI shape: a first chunk per choice with the assistant role, content
deltas, a final chunk with finish_reason, and a usage-only chunk when asked for. Tool calls
(serve/tools.py) come back as `tool_calls`, streamed as deltas with index, id, name, arguments.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

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
    chat_logprobs,
    public_reason,
    sse,
    usage_of,
)
from slipstream.serve.params import chat_params, check_common
from slipstream.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    random_id,
)
from slipstream.serve.streaming import SSEResponse, run_until_disconnect
from slipstream.serve.tools import ToolCallStream, ToolPlan, chat_template_inputs, plan_tools


async def render_chat(ctx: ServeContext, messages: list[ChatMessage],
                      add_generation_prompt: bool, tools: ToolPlan | None = None) -> list[int]:
    """Token ids of the rendered conversation (rendered and encoded off the event loop);
    template problems are the client's 400."""
    if ctx.prompts is None:
        raise APIError("this model has no tokenizer, so no chat template: use "
                       "/v1/completions with token ids", param="messages")
    dicts, extra = chat_template_inputs(messages, tools, ctx.tokenizer, ctx.tool_parser)
    try:
        return await ctx.prompts.encode_chat(dicts, add_generation_prompt, **extra)
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        raise APIError(f"messages: {exc}", param="messages") from exc
    except Exception as exc:  # noqa: BLE001 - jinja raise_exception() in a template
        if type(exc).__module__.startswith("jinja2"):
            raise APIError(f"messages: the chat template rejected them: {exc}",
                           param="messages") from exc
        raise


async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request,
                                 ctx: ServeContext) -> Response:
    ctx.check_model(req.model)
    check_common(req, ctx.limits)
    tools = plan_tools(req, ctx.tool_parser)
    prompt_ids = await render_chat(ctx, req.messages, req.add_generation_prompt, tools)
    if not prompt_ids:
        raise APIError("messages rendered to an empty prompt", param="messages")
    params = chat_params(req, len(prompt_ids), ctx.limits,
                         tools.constraint if tools is not None else None)
    request_id = random_id("chatcmpl")
    stream = start_generation(ctx, prompt_ids, params, request_id, req.priority,
                              ctx.lora_for(req.model))
    job = _ChatJob(req, ctx, request_id, params, tools)

    async def abort() -> None:
        await ctx.engine.abort(request_id)

    if req.stream:
        return SSEResponse(job.stream(stream), on_close=abort)
    try:
        return await run_until_disconnect(raw_request, job.full(stream))
    finally:
        await abort()


class _ChatJob:
    def __init__(self, req: ChatCompletionRequest, ctx: ServeContext, request_id: str,
                 params: SamplingParams, tools: ToolPlan | None = None) -> None:
        self.req = req
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.ctx = ctx
        self.request_id = request_id
        self.params = params
        self.token_text = TokenText(ctx.tokenizer)
        self.model_name = ctx.response_model(req.model)
        self.num_top = req.top_logprobs or 0

    async def full(self, stream: AsyncIterator[RequestOutput]) -> Response:
        try:
            final = await last_output(stream)
        except Exception as exc:  # noqa: BLE001 - mapped to the right status
            raise to_api_error(exc) from exc
        choices = [self._choice(c) for c in sorted(final.outputs, key=lambda c: c.index)]
        body = ChatCompletionResponse(id=self.request_id, model=self.model_name,
                                      choices=choices, usage=usage_of([final]))
        return JSONResponse(body.model_dump(mode="json"))

    def _choice(self, c: CompletionOutput) -> ChatChoice:
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_logprobs(self.token_text, c.token_ids, c.logprobs or [], self.num_top)
        content, calls = c.text, []
        finish_reason = public_reason(c.finish_reason)
        if self.tools is not None:
            content, calls = self.tools.extract(c.text)
            if calls and finish_reason == "stop" and self.tools.mode != "named":
                finish_reason = "tool_calls"  # OpenAI: a forced function ends with "stop"
        return ChatChoice(index=c.index,
                          message=ChatResponseMessage(content=content, tool_calls=calls),
                          logprobs=logprobs, finish_reason=finish_reason,
                          stop_reason=c.stop_reason)

    async def stream(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        cursors = [ChoiceCursor() for _ in range(self.req.n)]
        if self.tools is not None:
            tool_streams = [ToolCallStream(self.tools) for _ in range(self.req.n)]
        final = None
        try:
            async for out in stream:
                final = out
                for c in out.outputs:
                    chunks = (self._chunks(c, cursors[c.index]) if self.tools is None else
                              self._tool_chunks(c, cursors[c.index], tool_streams[c.index]))
                    for chunk in chunks:
                        yield sse(chunk)
            if include_usage and final is not None:
                yield sse(ChatCompletionChunk(id=self.request_id, model=self.model_name,
                                              choices=[], usage=usage_of([final]))
                          .model_dump_json())
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            yield sse(stream_error_event(exc))
        yield SSE_DONE

    def _chunks(self, c: CompletionOutput, cursor: ChoiceCursor) -> list[str]:
        delta = cursor.advance(c, self.params.stop)
        if delta is None:
            return []
        chunks = []
        if delta.first:  # the role goes first, on its own, as OpenAI does
            chunks.append(self._chunk(c.index, DeltaMessage(role="assistant", content="")))
        if delta.text or delta.token_ids or delta.finish_reason:
            logprobs = None
            if self.req.logprobs and delta.token_ids:
                logprobs = chat_logprobs(self.token_text, delta.token_ids,
                                         delta.logprobs or [], self.num_top)
            chunks.append(self._chunk(
                c.index, DeltaMessage(content=delta.text), logprobs, delta.finish_reason,
                delta.stop_reason if delta.finish_reason else None))
        return chunks

    def _tool_chunks(self, c: CompletionOutput, cursor: ChoiceCursor,
                     tools: ToolCallStream) -> list[str]:
        """Chunks of a choice with tools: content while no tool call has started, then the
        calls (serve/tools.py); logprobs are not sent in these streams."""
        sent_before = cursor.num_chars
        delta = cursor.advance(c, self.params.stop)
        if delta is None:
            return []
        chunks = []
        if delta.first:
            chunks.append(self._chunk(c.index, DeltaMessage(role="assistant", content="")))
        text = c.text[:cursor.num_chars]
        if tools.plan.mode == "named":
            calls = tools.named_delta(text, sent_before)
            if calls:
                chunks.append(self._chunk(c.index, DeltaMessage(tool_calls=calls)))
        elif delta.finish_reason is None:
            content = tools.content_delta(text)
            if content:
                chunks.append(self._chunk(c.index, DeltaMessage(content=content)))
            calls = tools.call_deltas(text)
            if calls:
                chunks.append(self._chunk(c.index, DeltaMessage(tool_calls=calls)))
        if delta.finish_reason is not None:
            content, calls = tools.final(c.text)
            if content:
                chunks.append(self._chunk(c.index, DeltaMessage(content=content)))
            if calls:
                chunks.append(self._chunk(c.index, DeltaMessage(tool_calls=calls)))
            reason = delta.finish_reason
            if tools.found_calls and reason == "stop":
                reason = "tool_calls"
            chunks.append(self._chunk(c.index, DeltaMessage(), None, reason,
                                      delta.stop_reason))
        return chunks

    def _chunk(self, index: int, delta: DeltaMessage, logprobs=None,
               finish_reason: str | None = None, stop_reason=None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                 finish_reason=finish_reason, stop_reason=stop_reason)
        return ChatCompletionChunk(id=self.request_id, model=self.model_name,
                                   choices=[choice]).model_dump_json()
