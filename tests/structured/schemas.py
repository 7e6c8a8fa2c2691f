"""Random JSON schemas whose every instance is short: nested objects, arrays, enums, integers
with bounds, required fields, string patterns; strings and arrays have bounded length, so any
path through the grammar ends within a few hundred tokens, even for a random model."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "enum", "string", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None, True], k=3)}
    if kind == "string":
        if rng.random() < 0.5:
            return {"type": "string", "pattern": "^[a-z]{1,6}$"}
        return {"type": "string", "minLength": 1, "maxLength": 6}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": 3}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "pos"], k=rng.randint(1, 3))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_object_schemas(seed: int, count: int) -> list[dict]:
    """`count` distinct schemas, each a top-level object (what json_schema clients send)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        schema = random_schema(rng, depth=1) if rng.random() < 0.3 else random_schema(rng, 0)
        if schema.get("type") != "object":
            schema = {
                "type": "object",
                "properties": {"value": schema},
                "required": ["value"],
                "additionalProperties": False,
            }
        if schema not in out:
            out.append(schema)
    return out
