"""JSON schemas of varied shape for structured-output checks and benchmarks: nested objects, arrays of
scalars and of objects, enums, bounded integers and numbers, optional and nullable fields, patterns.

`finite=True` keeps every schema's language finite (strings with maxLength, arrays with maxItems,
integers bounded, no fractional numbers): any sampler, a random model's included, then ends a
valid document within a bounded number of tokens, so a check of 100% validity cannot depend on the
model's luck. `finite=False` adds numbers (fractions of any length) for real-model benchmarks.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "city", "title", "label", "code", "owner", "status", "kind", "color", "note", "unit", "tag"]
_ENUMS = [
    ["red", "green", "blue"],
    ["low", "medium", "high"],
    ["draft", "published", "archived"],
    ["cat", "dog", "bird", "fish"],
    ["north", "south", "east", "west"],
]
_PATTERNS = ["^[A-Z]{2}[0-9]{3}$", "^[a-z]{3,6}$", "^[0-9]{4}-[0-9]{2}$"]


def _scalar(rng: random.Random, finite: bool) -> dict[str, Any]:
    kinds = ["string", "integer", "boolean", "enum", "pattern", "nullable"] + ([] if finite else ["number"])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    if kind == "integer":
        lo = rng.choice([0, -50, 1])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([10, 100, 1000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.choice(_ENUMS)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    return {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}


def _object(rng: random.Random, depth: int, finite: bool) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    props: dict[str, Any] = {}
    for k in keys:
        r = rng.random()
        if depth > 0 and r < 0.25:
            props[k] = _object(rng, depth - 1, finite)
        elif r < 0.45:
            item = _object(rng, 0, finite) if depth > 0 and rng.random() < 0.4 else _scalar(rng, finite)
            props[k] = {"type": "array", "items": item, "maxItems": rng.choice([2, 3, 4])}
            if rng.random() < 0.5:
                props[k]["minItems"] = 1
        else:
            props[k] = _scalar(rng, finite)
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": required}


def schemas(n: int = 50, seed: int = 0, finite: bool = True) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, depth=rng.choice([0, 1, 2]), finite=finite) for _ in range(n)]
