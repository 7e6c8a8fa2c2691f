"""Tool-call parsers: the model's text -> (content, tool calls), one per output format.

`--tool-call-parser` picks one: hermes (`<tool_call>{"name", "arguments"}</tool_call>`),
llama3_json (`{"name", "parameters"}` objects, `;`-separated, after an optional
`<|python_tag|>`), mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`) and pythonic
(`[f(a=1), g(b="x")]`). Each also writes its format for a chat template that has no tools
section (serve/tools.py supplies one) and finds where a stream's tool calls start, so content
before them streams while the calls are held until they are whole.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


class ToolParser:
    name = ""
    start_marker = ""  # text that opens the tool calls
    # Keys of a call object's arguments, for streaming them as they come (serve/tools.py);
    # empty: the format is not JSON objects, each call is sent whole at the end.
    args_keys: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content or None, calls); text that does not parse as calls stays content."""
        raise NotImplementedError

    def render(self, calls: list[ParsedCall]) -> str:
        """How the model writes `calls` (assistant turns, for the supplied tools section)."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call a tool, for the supplied tools section."""
        example = self.render([ParsedCall("function_name", '{"argument": "value"}')])
        return f"To call a function, answer with:\n{example}"

    def calls_start(self, text: str) -> int | None:
        """Index where tool calls start in a stream's text so far, or None."""
        i = text.find(self.start_marker)
        return i if i >= 0 else None

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` that may be the start of the marker (not sent yet)."""
        marker = self.start_marker
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                return n
        return 0


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


def _call_of(obj: object, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    args_keys = ("arguments",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.start_marker)
        if start < 0:
            return _content(text), []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call_of(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return _content(text), []
            calls.append(call)
        return _content(text[:start]), calls

    def render(self, calls):
        return "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
            for c in calls
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_marker = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.start_marker):
            body = body[len(self.start_marker) :].strip()
        if not body.startswith("{"):
            return _content(text), []
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return _content(text), []
            call = _call_of(obj, "parameters")
            if call is None:
                return _content(text), []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def render(self, calls):
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def calls_start(self, text):
        stripped = text.lstrip()
        if stripped.startswith(("{", self.start_marker)):
            return len(text) - len(stripped)
        return None

    def held_back(self, text):
        return len(text) if not text.strip() or self.start_marker.startswith(text.lstrip()) else 0


class MistralParser(ToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    args_keys = ("arguments",)

    def parse(self, text):
        start = text.find(self.start_marker)
        if start < 0:
            return _content(text), []
        try:
            objs = json.loads(text[start + len(self.start_marker) :].strip())
        except ValueError:
            return _content(text), []
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call_of(o, "arguments") for o in objs]
        if not calls or any(c is None for c in calls):
            return _content(text), []
        return _content(text[:start]), calls

    def render(self, calls):
        items = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"{self.start_marker}[{items}]"


class PythonicParser(ToolParser):
    name = "pythonic"
    start_marker = "["

    def parse(self, text):
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return _content(text), []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return _content(text), []
        if not isinstance(tree, ast.List) or not tree.elts:
            return _content(text), []
        calls = []
        for node in tree.elts:
            call = _pythonic_call(node)
            if call is None:
                return _content(text), []
            calls.append(call)
        return None, calls

    def render(self, calls):
        def one(c: ParsedCall) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in json.loads(c.arguments).items())
            return f"{c.name}({args})"

        return "[" + ", ".join(one(c) for c in calls) + "]"

    def calls_start(self, text):
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def held_back(self, text):
        return len(text) if not text.strip() else 0


def _pythonic_call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        return None
    return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}") from None
