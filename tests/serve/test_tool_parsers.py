"""Tool-call parsers and the tool-call stream: each format parses what it renders, text that is
not a call stays content, and a stream's deltas assemble to the whole reply's calls."""

from __future__ import annotations

import json

import pytest

from slipstream.serve.protocol import ChatCompletionRequest, ChatMessage
from slipstream.serve.tool_parsers import PARSERS, ParsedCall, get_tool_parser
from slipstream.serve.tools import ToolCallStream, ToolPlan, chat_template_inputs, plan_tools

CALLS = [
    ParsedCall("get_weather", json.dumps({"city": "Paris", "days": 2})),
    ParsedCall("add", json.dumps({"a": 1, "b": [2, "x"]})),
]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parse_what_is_rendered(name):
    parser = get_tool_parser(name)
    content, calls = parser.parse(parser.render(CALLS))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in CALLS
    ]
    assert parser.parse("just words, no call") == ("just words, no call", [])


def test_formats_as_models_write_them():
    hermes = get_tool_parser("hermes")
    content, calls = hermes.parse(
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert content == "Let me check." and calls == [ParsedCall("f", '{"x": 1}')]
    assert hermes.parse("<tool_call>{not json</tool_call>")[1] == []
    _, calls = get_tool_parser("llama3_json").parse(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    )
    assert [c.name for c in calls] == ["f", "g"]
    content, calls = get_tool_parser("mistral").parse(
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": "y"}}]'
    )
    assert content == "ok" and calls == [ParsedCall("f", '{"x": "y"}')]
    _, calls = get_tool_parser("pythonic").parse('[f(x=1, y="a"), g()]')
    assert calls == [ParsedCall("f", '{"x": 1, "y": "a"}'), ParsedCall("g", "{}")]
    assert get_tool_parser("pythonic").parse("[1, 2]")[1] == []
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def _stream_by_characters(plan: ToolPlan, text: str) -> tuple[str, dict[int, list], list]:
    """Feed the reply one character at a time: (content, deltas per call index, all deltas)."""
    stream = ToolCallStream(plan)
    content, deltas = "", []
    for i in range(1, len(text) + 1):
        content += stream.content_delta(text[:i])
        deltas += stream.call_deltas(text[:i])
    rest, last = stream.final(text)
    content += rest
    deltas += last
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index not in calls:  # the first delta of a call names it, with its id
            assert d.id and d.type == "function" and d.function.name
            calls[d.index] = [d.id, d.function.name, ""]
        else:
            assert d.id is None and d.function.name is None
        calls[d.index][2] += d.function.arguments or ""
    return content, calls, deltas


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_stream_assembles_to_the_whole_reply(name):
    parser = get_tool_parser(name)
    prefix = "Sure. " if name in ("hermes", "mistral") else ""
    text = prefix + parser.render(CALLS)
    plan = ToolPlan("auto", [], parser)
    sent, calls, deltas = _stream_by_characters(plan, text)
    content, want = plan.extract(text)
    assert sent == (content or "")
    assert [(name, args) for _, name, args in calls.values()] == [
        (c.function.name, c.function.arguments) for c in want
    ]
    assert sorted(calls) == list(range(len(CALLS)))
    if parser.args_keys:  # JSON formats stream the arguments in pieces, before the end
        assert sum(1 for d in deltas if d.index == 0) > 3


@pytest.mark.parametrize(
    "args",
    [
        '{"city": "Pa\\"ris\\u00e9\\ud83d\\ude00 x", "n": [1, -2.50e3, true, null], "o": {}}',
        '{ "a" : 1 ,"b":{"c":[ ]},"d":"\\n\\t"}',
        "{}",
    ],
)
def test_streamed_arguments_are_the_parsed_arguments(args):
    """Spacing, escapes, surrogate pairs and numbers as a model may write them: the fragments
    assemble to exactly the arguments of the whole reply's parse."""
    text = f'ok <tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
    plan = ToolPlan("auto", [], get_tool_parser("hermes"))
    _, calls, _ = _stream_by_characters(plan, text)
    _, want = plan.extract(text)
    assert [c[2] for c in calls.values()] == [want[0].function.arguments]
    assert json.loads(calls[0][2]) == json.loads(args)


def test_one_call_streams_when_calls_are_not_parallel():
    parser = get_tool_parser("hermes")
    text = parser.render(CALLS)
    _, calls, _ = _stream_by_characters(ToolPlan("auto", [], parser, parallel=False), text)
    assert [c[1] for c in calls.values()] == ["get_weather"]


def test_plain_text_streams_whole():
    stream = ToolCallStream(ToolPlan("auto", [], get_tool_parser("hermes")))
    text = "a <tool reply that is not a call"
    sent = "".join(stream.content_delta(text[:i]) for i in range(1, len(text) + 1))
    rest, deltas = stream.final(text)
    assert sent + rest == text and deltas == []


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


class _Tok:
    def __init__(self, template):
        self.hf = type("HF", (), {"chat_template": template})()


def _conversation():
    return [
        ChatMessage.model_validate(m)
        for m in (
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        )
    ]


def test_tools_go_to_a_template_that_has_them():
    from jinja2 import Template

    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}
    )
    parser = get_tool_parser("hermes")
    dicts, extra = chat_template_inputs(
        _conversation(), plan_tools(req, parser), _Tok(NATIVE_TEMPLATE), parser
    )
    text = Template(NATIVE_TEMPLATE).render(messages=dicts, **extra)
    assert text == 'TOOLS:add;\nuser:hi\nassistant:[add {"a": 1}]\ntool:2#c1\n'


def test_a_tools_section_is_supplied_where_the_template_has_none():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "auto"}
    )
    parser = get_tool_parser("hermes")
    dicts, extra = chat_template_inputs(
        _conversation(), plan_tools(req, parser), _Tok("{{ messages }}"), parser
    )
    assert extra == {}
    assert dicts[0]["role"] == "system" and '"name": "add"' in dicts[0]["content"]
    assert "<tool_call>" in dicts[0]["content"]
    assert dicts[2] == {"role": "assistant", "content": parser.render([ParsedCall("add", '{"a": 1}')])}
    assert dicts[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}


def test_required_calls_stream_their_arguments():
    """Replies of tool_choice "required" (a JSON array of {"name", "arguments"}) stream alike."""
    text = '[{"name": "add", "arguments": {"a": 1, "b": [2, "x"]}}, {"name": "g", "arguments": {}}]'
    plan = ToolPlan("required", [], get_tool_parser("hermes"))
    content, calls, deltas = _stream_by_characters(plan, text)
    _, want = plan.extract(text)
    assert content == ""
    assert [(c[1], c[2]) for c in calls.values()] == [(c.function.name, c.function.arguments) for c in want]
    assert sum(1 for d in deltas if d.index == 0) > 3
