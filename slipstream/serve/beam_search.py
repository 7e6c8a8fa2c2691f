"""/v1/completions with `use_beam_search` (vLLM's fields): best_of (else n) beams per prompt,
the n best hypotheses returned as choices, best first. Not streamed; sampling fields that
beam search cannot honour are a 400 naming them."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from slipstream.sampling.beam_search import BeamSearchParams
from slipstream.serve.context import ServeContext, to_api_error
from slipstream.serve.errors import APIError
from slipstream.serve.params import check_common, resolve_max_tokens
from slipstream.serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from slipstream.serve.streaming import gather_or_cancel, run_until_disconnect

# Fields whose non-default values beam search does not take.
_UNSUPPORTED = {"stream": False, "logprobs": None, "suffix": None, "seed": None, "stop": None,
                "stop_token_ids": None, "top_p": None, "top_k": None, "min_p": None,
                "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None,
                "min_tokens": 0}


def beam_params(req: CompletionRequest, prompt_len: int, ctx: ServeContext) -> BeamSearchParams:
    for name, default in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value != default and value not in ([], ""):
            raise APIError(f"{name} is not supported with use_beam_search", param=name)
    if req.temperature not in (None, 0.0):
        raise APIError("use_beam_search takes temperature 0 (or unset)", param="temperature")
    width = req.best_of if req.best_of is not None else req.n
    if req.n > width:
        raise APIError(f"n ({req.n}) must be at most best_of ({width}), the beam width",
                       param="best_of")
    max_tokens = resolve_max_tokens(req.max_tokens, prompt_len, ctx.limits)
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                ignore_eos=req.ignore_eos, length_penalty=req.length_penalty)
    except ValueError as exc:
        raise APIError(str(exc), param="best_of" if "beam_width" in str(exc) else None) from exc


async def create_beam_completion(req: CompletionRequest, raw_request: Request, ctx: ServeContext,
                                 prompts_of: Callable) -> Response:
    ctx.check_model(req.model)
    check_common(req, ctx.limits)
    prompts = await prompts_of(req, ctx)
    params = [beam_params(req, len(ids), ctx) for _, ids in prompts]
    request_id = random_id("cmpl")

    async def run() -> Response:
        jobs = [ctx.engine.beam_search(ids, p, f"{request_id}-{i}", req.priority)
                for i, ((_, ids), p) in enumerate(zip(prompts, params))]
        try:
            results = await gather_or_cancel(jobs)
        except Exception as exc:  # noqa: BLE001 - engine death, a bad request
            raise to_api_error(exc) from exc
        choices, completion_tokens = [], 0
        for p_idx, ((prompt_text, _), out) in enumerate(zip(prompts, results)):
            for i, seq in enumerate(out.sequences[: req.n]):
                text = ctx.decode(seq.output_token_ids, skip_special_tokens=req.skip_special_tokens)
                choices.append(CompletionChoice(
                    index=p_idx * req.n + i, text=(prompt_text if req.echo else "") + text,
                    finish_reason=seq.finish_reason))
                completion_tokens += len(seq.output_token_ids)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        body = CompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=usage)
        return JSONResponse(body.model_dump(mode="json"))

    return await run_until_disconnect(raw_request, run())
