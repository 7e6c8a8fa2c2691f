"""StructuredOutputsParams: the one constraint a request's output must follow.

Exactly one of `json` (a JSON schema), `json_object`, `regex`, `grammar` (EBNF, xgrammar's
dialect) or `choice` is set. Construction checks the constraint itself (an invalid schema,
regex or grammar is a ValueError naming the field) without a tokenizer: that part is fast;
the engine compiles it against the vocabulary later, off the step loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "json_object", "regex", "grammar", "choice")
# xgrammar prefixes its errors with "[time] /path/file.cc:line: "; the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    # JSON: allow any whitespace between tokens. Off, the output is compact JSON, which a model
    # cannot stretch with endless blanks.
    any_whitespace: bool = False
    _checked: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if self.choice is not None:
            self.choice = list(self.choice)
        self._check_shape()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """Equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True) + f"|ws={self.any_whitespace}"
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)

    def _check_shape(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, regex, "
                f"grammar or choice (got {', '.join(chosen) or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json: a JSON schema must be an object, got {type(self.json).__name__}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def check(self) -> None:
        """Parse the constraint (no vocabulary needed); ValueError naming the field if it is
        invalid. Runs once per object: clones of a request share it."""
        if self._checked:
            return
        build_grammar(self)
        self._checked = True

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*_KINDS, "any_whitespace")}


def choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes, so json.dumps quotes each choice exactly.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar.Grammar of `params` (not compiled); ValueError naming the field."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                json.dumps(_bounded_strings_escaped(params.json)), any_whitespace=params.any_whitespace
            )
        if kind == "json_object":  # any object (OpenAI's json_object), not any JSON value
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, any_whitespace=params.any_whitespace
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _XGRAMMAR_PREFIX.sub(
            "", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        )
        raise ValueError(f"structured_outputs.{kind}: {message}") from None


def _bounded_strings_escaped(schema: Any) -> Any:
    """A copy of `schema` where a string with minLength / maxLength (and no pattern or
    format) gets the same bounds as a pattern of characters JSON needs no escape for: xgrammar
    turns the bare bounds into a character class that lets control characters through, which
    strict JSON parsers reject."""
    if isinstance(schema, list):
        return [_bounded_strings_escaped(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings_escaped(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(low, int) and (high == "" or isinstance(high, int)):
            out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
            out.pop("minLength", None)  # the pattern holds them (xgrammar takes one or the other)
            out.pop("maxLength", None)
    return out


def coerce(value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
    """A StructuredOutputsParams from itself or its dict form (as it crosses to the engine)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        known = {k: v for k, v in value.items() if not k.startswith("_")}
        try:
            return StructuredOutputsParams(**known)
        except TypeError as exc:
            raise ValueError(f"structured_outputs: {exc}") from None
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}")
