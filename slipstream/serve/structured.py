"""OpenAI's `response_format` and vLLM's `guided_*` extras -> StructuredOutputsParams, and the
logit controls (`logit_bias`, `allowed_token_ids`, `bad_words`) -> SamplingParams fields.

Every problem is a 400 naming the request field that caused it.
"""

from __future__ import annotations

from typing import Any

from slipstream.serve.errors import APIError
from slipstream.serve.protocol import SamplingFields
from slipstream.structured.params import StructuredOutputsParams

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, checked (an invalid schema, regex or grammar is a 400
    naming its field), or None."""
    if req.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported", param="guided_whitespace_pattern")
    given = [name for name in _GUIDED if getattr(req, name) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise APIError(f"give at most one output constraint, got {', '.join(given)}", param=given[1])
    if not given:
        return None
    param = given[0]
    return constraint(param, _kwargs_of(req, param))


def constraint(param: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), checked; its errors name `param`."""
    try:
        params = StructuredOutputsParams(**kwargs)
        params.check()
    except ValueError as exc:
        message = str(exc)
        if message.startswith("structured_outputs"):
            message = message.split(":", 1)[1].strip() if ":" in message else message
        raise APIError(f"{param}: {message}", param=param) from None
    return params


def _kwargs_of(req: SamplingFields, param: str) -> dict[str, Any]:
    if param == "guided_json":
        return {"json": req.guided_json}
    if param == "guided_regex":
        return {"regex": req.guided_regex}
    if param == "guided_choice":
        return {"choice": req.guided_choice}
    if param == "guided_grammar":
        return {"grammar": req.guided_grammar}
    fmt = req.response_format
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None:
        raise APIError(
            "response_format: type json_schema needs a json_schema object", param="response_format"
        )
    return {"json": fmt.json_schema.schema_}


def logit_control_kwargs(req: SamplingFields) -> dict[str, Any]:
    """logit_bias (string keys -> token ids), allowed_token_ids and bad_words."""
    out: dict[str, Any] = {}
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        out["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        out["bad_words"] = list(req.bad_words)
    return out
