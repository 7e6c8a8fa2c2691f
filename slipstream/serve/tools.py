"""Tool calling for /v1/chat/completions: what `tool_choice` asks for, the messages as the chat
template sees them, and the model's answer as OpenAI tool calls.

- "auto": the tools go to the template; the reply is parsed by the server's tool parser.
- "required" / a named function: constrained decoding makes the reply a JSON array of
  {"name", "arguments"} (one of the tools each) / the named function's arguments, so the
  arguments always validate against the function's parameters.
- "none": no tools are rendered and nothing is parsed.

A chat template without a tools section (the default model's) gets one from slipstream: a
system message listing the tools and the parser's call format; assistant tool calls and tool
results are written into the conversation as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slipstream.serve.errors import APIError
from slipstream.serve.partial_json import normalized_prefix, scan_calls
from slipstream.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from slipstream.serve.structured import constraint
from slipstream.serve.tool_parsers import ParsedCall, ToolParser
from slipstream.structured.params import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[ChatTool]
    parser: ToolParser
    named: str | None = None
    parallel: bool = True

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return constraint("tool_choice", {"json": tool.function.parameters or _ANY_OBJECT})
        if self.mode == "required":
            return constraint("tools", {"json": self._required_schema()})
        return None

    def _required_schema(self) -> dict:
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [t.function.name]},
                    "arguments": t.function.parameters or _ANY_OBJECT,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole reply."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [_tool_call(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: no calls to report
                return text, []
            return None, [
                _tool_call(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items
            ]
        content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        return content, [_tool_call(c.name, c.arguments) for c in calls]


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))


def plan_tools(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    """The request's tool handling, or None when it brings no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be distinct", param="tools")
    for tool in req.tools:
        params = tool.function.parameters
        if params is not None:
            constraint("tools", {"json": params})  # a bad schema is a 400 before anything runs
    if choice is None or isinstance(choice, str):
        return ToolPlan(choice or "auto", req.tools, parser, parallel=req.parallel_tool_calls)
    if choice.function.name not in names:
        raise APIError(
            f"tool_choice: no tool named {choice.function.name!r} in tools ({', '.join(names)})",
            param="tool_choice",
        )
    return ToolPlan("named", req.tools, parser, choice.function.name)


# ----------------------------------------------------------------------------- rendering


def template_has_tools(tokenizer: Any) -> bool:
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def chat_template_inputs(
    messages: list[ChatMessage], plan: ToolPlan | None, tokenizer: Any, parser: ToolParser
) -> tuple[list[dict], dict]:
    """(message dicts, extra template kwargs) for the tokenizer's chat template."""
    native = template_has_tools(tokenizer)
    dicts = [_native_message(m) if native else _text_message(m, parser) for m in messages]
    if plan is None or plan.mode == "none":
        return dicts, {}
    tools = [t.model_dump(exclude_none=True) for t in plan.tools]
    if native:
        return dicts, {"tools": tools}
    return _with_tools_section(dicts, tools, parser), {}


def _native_message(m: ChatMessage) -> dict:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    return out


def _arguments_value(arguments: str) -> Any:
    """Templates write arguments with `| tojson`: hand them the object when it is JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _text_message(m: ChatMessage, parser: ToolParser) -> dict:
    """A message for a template that knows only system / user / assistant text."""
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        calls = parser.render([ParsedCall(c.function.name, c.function.arguments) for c in m.tool_calls])
        out["content"] = (out["content"] + "\n" + calls).strip()
    return out


def _with_tools_section(dicts: list[dict], tools: list[dict], parser: ToolParser) -> list[dict]:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    section = f"You can call these functions:\n<tools>\n{listing}\n</tools>\n{parser.instructions()}"
    if dicts and dicts[0]["role"] == "system":
        first = dict(dicts[0], content=f"{dicts[0]['content']}\n\n{section}")
        return [first, *dicts[1:]]
    return [{"role": "system", "content": section}, *dicts]


# ----------------------------------------------------------------------------- streaming


class ToolCallStream:
    """One choice's stream: content deltas until the tool calls start (a possible start is held
    back), then the calls. With a JSON-writing parser (and with "required", whose reply is a
    JSON array of {"name", "arguments"}) each call streams as OpenAI streams it:
    a first delta with index, id, type and name once the name is complete, then fragments of
    its arguments as they become certain (serve/partial_json.py); once the reply is complete,
    whatever the whole reply's parse adds. Other parsers (pythonic) send each call whole at the
    end. A named function streams its arguments as they come."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._sent = 0  # characters of content sent
        self._in_calls = plan.mode in ("named", "required")
        # Where the tool calls start in the text ("required": a JSON array from the start).
        self._calls_at: int | None = 0 if plan.mode == "required" else None
        self._named_id: str | None = None
        self._streamed: list[tuple[str, str]] = []  # (id, arguments sent) per call started
        self.found_calls = False  # the whole reply's parse found calls (set by final)

    def content_delta(self, text: str) -> str:
        """New content to send for the text so far (while the reply runs)."""
        if self.plan.mode == "named":
            return ""
        if self._in_calls:
            return ""
        parser = self.plan.parser
        start = parser.calls_start(text)
        if start is not None:
            self._in_calls = True
            self._calls_at = start
            visible = text[:start]
        else:
            visible = text[: len(text) - parser.held_back(text)]
        # The parsed content is stripped: blanks are sent once text follows them.
        visible = visible.strip()
        new = visible[self._sent :]
        self._sent = max(self._sent, len(visible))
        return new

    def call_deltas(self, text: str) -> list[DeltaToolCall]:
        """Deltas of the calls in the text so far ("auto" after content_delta, "required")."""
        keys = ("arguments",) if self.plan.mode == "required" else self.plan.parser.args_keys
        if self.plan.mode not in ("auto", "required") or self._calls_at is None or not keys:
            return []
        scans = scan_calls(text, self._calls_at, keys)
        if not self.plan.parallel:
            scans = scans[:1]
        deltas = []
        for i, scan in enumerate(scans):
            if scan.name is None:
                break  # calls start in order: a later one waits for this one's name
            args = ""
            if scan.args_start is not None:
                args = normalized_prefix(text, scan.args_start, scan.args_end)
            if i == len(self._streamed):
                call_id = _tool_call(scan.name, "").id
                self._streamed.append((call_id, args))
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=call_id,
                        type="function",
                        function=DeltaFunctionCall(name=scan.name, arguments=args),
                    )
                )
            elif len(args) > len(self._streamed[i][1]):
                call_id, sent = self._streamed[i]
                self._streamed[i] = (call_id, args)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[len(sent) :])))
        return deltas

    def named_delta(self, text: str, num_sent: int) -> list[DeltaToolCall]:
        """A named function: its arguments text as it grows."""
        new = text[num_sent:]
        if self._named_id is None:
            self._named_id = _tool_call(self.plan.named, "").id
            return [
                DeltaToolCall(
                    index=0,
                    id=self._named_id,
                    type="function",
                    function=DeltaFunctionCall(name=self.plan.named, arguments=new),
                )
            ]
        if not new:
            return []
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))]

    def final(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """(content not sent yet, the calls' deltas not sent yet) once the reply is complete."""
        if self.plan.mode == "named":
            return "", []
        content, calls = self.plan.extract(text)
        self.found_calls = bool(calls)
        rest = (content or "")[self._sent :]
        deltas = []
        for i, c in enumerate(calls):
            if i < len(self._streamed):
                sent = self._streamed[i][1]
                args = c.function.arguments
                if len(args) > len(sent) and args.startswith(sent):
                    deltas.append(
                        DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[len(sent) :]))
                    )
                continue
            deltas.append(
                DeltaToolCall(
                    index=i,
                    id=c.id,
                    type="function",
                    function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
                )
            )
        return rest, deltas
