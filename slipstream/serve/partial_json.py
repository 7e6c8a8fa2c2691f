"""JSON written so far by a model, read token by token: where a tool call's name and arguments
are, and the arguments re-serialised as far as they are certain.

The server reports a call's arguments as `json.dumps(json.loads(raw), ensure_ascii=False)`.
That text is the raw JSON's tokens, whitespace dropped, `, ` and `: ` as separators and each
string or number written again on its own. So a prefix of the raw text gives a prefix of the
final arguments: every complete token, plus the characters of an unfinished string that are
already whole (an escape waits for its last character). Numbers and literals wait until the
next character shows they ended. A stream of these prefixes assembles to the final text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789.eE+-")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # json.loads takes all
_SPACE = " \t\n\r"
_SEPARATORS = {",": ", ", ":": ": "}


@dataclass
class Token:
    kind: str  # one of "{}[],:" or "str", "num", "lit"
    start: int
    end: int
    complete: bool


def tokens(text: str, pos: int) -> Iterator[Token]:
    """Tokens from `pos` on; the last may be incomplete (the text ends inside it). Stops at a
    character that cannot continue JSON."""
    n = len(text)
    while pos < n:
        ch = text[pos]
        if ch in _SPACE:
            pos += 1
            continue
        if ch in "{}[],:":
            yield Token(ch, pos, pos + 1, True)
            pos += 1
            continue
        if ch == '"':
            end = _string_end(text, pos)
            yield Token("str", pos, n if end is None else end, end is not None)
            if end is None:
                return
            pos = end
            continue
        token = _number_or_literal(text, pos)
        if token is None:
            return
        yield token
        if not token.complete:
            return
        pos = token.end


def _string_end(text: str, pos: int) -> int | None:
    """Index after the closing quote of the string opening at pos, or None."""
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
        elif ch == '"':
            return i + 1
        else:
            i += 1
    return None


def _number_or_literal(text: str, pos: int) -> Token | None:
    rest = text[pos:]
    for word in _LITERALS:
        if rest.startswith(word):
            return Token("lit", pos, pos + len(word), True)
        if word.startswith(rest):
            return Token("lit", pos, len(text), False)
    match = _NUMBER.match(text, pos)
    if match is None:
        return None
    end = match.end()
    if end == len(text):
        return Token("num", pos, end, False)
    if text[end] in _NUMBER_CHARS:
        return None  # e.g. "01" or "1.": not JSON
    return Token("num", pos, end, True)


def normalized_prefix(text: str, start: int, end: int | None = None) -> str:
    """The certain prefix of the re-serialised JSON value at text[start:end]."""
    out = []
    for token in tokens(text[: len(text) if end is None else end], start):
        raw = text[token.start : token.end]
        if token.kind in _SEPARATORS:
            out.append(_SEPARATORS[token.kind])
        elif token.kind in "{}[]":
            out.append(raw)
        elif not token.complete:
            if token.kind == "str":
                out.append(_partial_string(raw))
            break
        elif token.kind == "lit":
            out.append(raw)
        else:
            out.append(json.dumps(json.loads(raw), ensure_ascii=False))
    return "".join(out)


def _partial_string(raw: str) -> str:
    """An unfinished string token, re-serialised up to its last whole character."""
    body, i = raw[1:], 0
    while i < len(body):
        if body[i] != "\\":
            i += 1
            continue
        size = _escape_size(body, i)
        if size is None:
            break
        i += size
    try:
        decoded = json.loads('"' + body[:i] + '"')
    except ValueError:  # a raw control character: json.loads refuses the whole reply
        return ""
    return json.dumps(decoded, ensure_ascii=False)[:-1]


def _escape_size(body: str, i: int) -> int | None:
    """Length of the escape at body[i], or None while it is unfinished. A high surrogate
    waits for its low half: alone it is no character."""
    if i + 1 >= len(body):
        return None
    if body[i + 1] != "u":
        return 2
    if i + 6 > len(body):
        return None
    if 0xD800 <= int(body[i + 2 : i + 6], 16) <= 0xDBFF:
        return 12 if i + 12 <= len(body) else None
    return 6


@dataclass
class CallScan:
    """What the text shows so far of one call object {"name": ..., "<arguments>": {...}}."""

    start: int
    name: str | None = None  # once its string is complete
    args_start: int | None = None  # where the arguments object begins
    args_end: int | None = None  # after it, once closed
    end: int | None = None  # after the call object, once closed


def scan_calls(text: str, pos: int, args_keys: tuple[str, ...]) -> list[CallScan]:
    """The call objects from `pos` on: each `{` outside a call starts one (tags, `;` or the
    brackets of a list between them are skipped). The last may be unfinished."""
    calls = []
    while True:
        start = text.find("{", pos)
        if start < 0:
            return calls
        call = _scan_call(text, start, args_keys)
        calls.append(call)
        if call.end is None:
            return calls
        pos = call.end


def _scan_call(text: str, start: int, args_keys: tuple[str, ...]) -> CallScan:
    call = CallScan(start)
    depth, key, expect_key = 0, None, True
    for token in tokens(text, start):
        raw = text[token.start : token.end]
        if depth == 1:
            if token.kind == "str" and expect_key:
                if not token.complete:
                    return call
                key, expect_key = json.loads(raw), False
                continue
            if token.kind == ",":
                expect_key = True
                continue
            if token.kind == "}":
                call.end = token.end
                return call
            if key == "name" and token.kind == "str" and token.complete:
                call.name = json.loads(raw)
            if key in args_keys and token.kind == "{" and call.args_start is None:
                call.args_start = token.start
        if token.kind in "{[":
            depth += 1
        elif token.kind in "}]":
            depth -= 1
            if depth == 1 and call.args_start is not None and call.args_end is None:
                call.args_end = token.end
    return call
