"""serve/partial_json.py: every prefix of a JSON text, read as far as it is certain, is a prefix
of the server's final arguments text (json.dumps of the parse), and the whole text gives it
exactly; call objects are found with their name and arguments."""

from __future__ import annotations

import json
import random

from slipstream.serve.partial_json import normalized_prefix, scan_calls

_STRINGS = ["", 'a"b\\c\n\t', "😀 x", "\u0001z", "é/ü"]
_NUMBERS = [0, -1, 12345678901234567890, 1.5, -0.0, 1e-7, 2.5e20]


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.25:
        return {f'k{i}\n"é': _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.4:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.6:
        return rng.choice(_STRINGS)
    if r < 0.8:
        return rng.choice(_NUMBERS)
    return rng.choice([True, False, None])


def test_every_prefix_is_a_prefix_of_the_final_text():
    rng = random.Random(0)
    for _ in range(60):
        obj = {f"k{i}": _value(rng) for i in range(rng.randint(0, 4))}
        raw = json.dumps(
            obj,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 1]),
            separators=rng.choice([None, (",", ":"), (" , ", " :  ")]),
        )
        want = json.dumps(json.loads(raw), ensure_ascii=False)
        previous = ""
        for i in range(len(raw) + 1):
            got = normalized_prefix(raw[:i], 0)
            assert want.startswith(got) and got.startswith(previous), (raw[:i], got, want)
            previous = got
        assert normalized_prefix(raw, 0) == want


def test_numbers_and_escapes_wait_until_they_are_whole():
    assert normalized_prefix('{"a": 12', 0) == '{"a": '  # 123 or 12.5 may follow
    assert normalized_prefix('{"a": 12}', 0) == '{"a": 12}'
    assert normalized_prefix('{"a": tr', 0) == '{"a": '
    assert normalized_prefix('{"a": "x\\u00', 0) == '{"a": "x'
    assert normalized_prefix('{"a": "x\\ud83d', 0) == '{"a": "x'  # half a surrogate pair
    assert normalized_prefix('{"a": "x\\ud83d\\ude00', 0) == '{"a": "x😀'
    assert normalized_prefix('{"a": 01}', 0) == '{"a": '  # not JSON: nothing more is certain


def test_scan_calls_finds_names_and_arguments():
    text = (
        '<tool_call>{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {"z": "a'
    )
    first, second = scan_calls(text, 0, ("arguments",))
    assert first.name == "f" and first.end is not None
    assert text[first.args_start : first.args_end] == '{"x": [1, {"y": 2}]}'
    assert second.name == "g" and second.end is None and second.args_end is None
    assert normalized_prefix(text, second.args_start) == '{"z": "a'
    (partial,) = scan_calls('[TOOL_CALLS][{"na', 0, ("arguments",))
    assert partial.name is None
