"""Structured output and tool calling through the `openai` client, on a server of the default
model (its chat template has no tools section, so slipstream supplies one): response_format,
guided_* extras, named and "required" tool choices (arguments validate; streamed calls
assemble to the unstreamed ones), tool messages, and 400s that name the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from slipstream.assets import DEFAULT_MODEL_DIR
from tests.serve.server import API_KEY, MODEL, start_server, stop_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured_server") / "server.log"
    handle = start_server(
        DEFAULT_MODEL_DIR, log, extra=["--max-model-len", "1024", "--kv-cache-memory", str(64 * 2**20)]
    )
    yield openai.OpenAI(base_url=handle.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
    assert stop_server(handle) == 0, handle.log_tail()


def _chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", MESSAGES), max_tokens=kw.pop("max_tokens", 200), **kw
    )


def test_response_format_and_guided_extras(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    out = _chat(
        client,
        n=2,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema, "strict": True},
        },
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    out = _chat(client, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = _chat(client, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.completions.create(
        model=MODEL,
        prompt="x = ",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\d{3}-[a-z]{2}"},
    )
    assert re.fullmatch(r"\d{3}-[a-z]{2}", out.choices[0].text)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_named_tool_choice(client):
    out = _chat(
        client,
        temperature=0.7,
        seed=3,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [(name, args)] = _calls(choice.message)
    assert name == "add"
    jsonschema.validate(args, ADD)
    assert choice.message.tool_calls[0].id.startswith("call-")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client, parallel):
    out = _chat(
        client, temperature=0.9, seed=5, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _calls(choice.message)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        jsonschema.validate(args, PARAMS[name])


def _assemble(chunks) -> tuple[list[tuple[str, dict]], str | None]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
                assert d.id in (None, call["id"])
    assert all(c["id"] for c in calls.values())
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_tool_calls_equal_unstreamed(client, tool_choice):
    kw = dict(temperature=0, tools=TOOLS, tool_choice=tool_choice)
    full = _chat(client, **kw).choices[0]
    streamed, reason = _assemble(_chat(client, stream=True, **kw))
    assert streamed == _calls(full.message)
    assert reason == full.finish_reason


# The model is held to a hermes call (content first) so that "auto" has a call to parse.
AUTO_CALL = (
    r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{3,12}", "days": [1-7]\}\}\n</tool_call>'
)


def _assemble_auto(chunks) -> tuple[str, list[dict], str | None, int]:
    """(content, calls with id / name / arguments text, finish reason, argument deltas)."""
    content, calls, reason, fragments = "", {}, None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                    fragments += 1
                calls[d.index]["arguments"] += d.function.arguments or ""
    return content, [c for _, c in sorted(calls.items())], reason, fragments


def test_auto_tool_call_arguments_stream_in_pieces(client):
    kw = dict(temperature=0, tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": AUTO_CALL})
    full = _chat(client, **kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "Checking."
    content, calls, reason, fragments = _assemble_auto(_chat(client, stream=True, **kw))
    assert content == full.message.content and reason == full.finish_reason
    want = full.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in want
    ]  # the arguments text exactly, not only its parse
    assert fragments >= 3  # streamed as generated, not in one piece at the end
    assert all(c["id"].startswith("call-") for c in calls)


def test_tool_messages_round_trip(client):
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": '{"forecast": "sunny"}'},
    ]
    out = _chat(client, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            ),
            "response_format",
        ),
        (dict(extra_body={"guided_regex": "a(b"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "root ::= nowhere"}), "guided_grammar"),
        (dict(extra_body={"guided_choice": []}), "guided_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]),
            "tools",
        ),
        (dict(logit_bias={"999999": 5}), "logit_bias"),
        (dict(logit_bias={"5": 150}), "logit_bias"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "response_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
