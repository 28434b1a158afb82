"""A corpus of JSON schemas for structured-output tests and benchmarks, generated
deterministically: nesting, enums, anyOf, $ref, patterns, formats, array bounds, required and
optional mixes, unicode. Every schema closes its objects and bounds its strings and arrays, so
each has a finite longest instance and a random model's output always completes."""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

_NAMES = ("id", "name", "tags", "count", "ok", "score", "kind", "city", "note", "größe", "名前")
_WORDS = ("alpha", "beta", "gamma", "delta", "café", "naïve", "日本", "ok", "x-1", "Ω")
_PATTERNS = (r"^[a-z]{2,5}$", r"^[A-Z][0-9]{2}$", r"^(yes|no)$", r"^[0-9]{3}-[0-9]{2}$")
_FORMATS = ("date", "uuid", "ipv4")
"""Formats with a bounded length that llguidance and `jsonschema` read alike."""


def _leaf(rng: random.Random) -> Schema:
    pick = rng.randrange(9)
    if pick == 0:
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if pick == 1:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 900)}
    if pick == 2:
        return {"type": "boolean"}
    if pick == 3:
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if pick == 4:
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if pick == 5:
        return {"type": "string", "format": rng.choice(_FORMATS)}
    if pick == 6:
        return {"const": rng.choice(_WORDS)}
    if pick == 7:
        return {"type": "null"}
    return {"enum": [1, 2.5, "x", None, True][: rng.randint(1, 5)]}


def _node(rng: random.Random, depth: int) -> Schema:
    if depth <= 0:
        return _leaf(rng)
    pick = rng.randrange(5)
    if pick == 0:
        return _object(rng, depth - 1)
    if pick == 1:
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": _node(rng, depth - 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    if pick == 2:
        return {"anyOf": [_node(rng, depth - 1) for _ in range(rng.randint(2, 3))]}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> Schema:
    names = rng.sample(_NAMES, rng.randint(1, 4))
    properties = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _with_ref(rng: random.Random, depth: int) -> Schema:
    item = _object(rng, 0)
    return {
        "$defs": {"Item": item},
        "type": "object",
        "properties": {
            "first": {"$ref": "#/$defs/Item"},
            "rest": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2},
            "extra": _node(rng, depth),
        },
        "required": ["first", "rest"],
        "additionalProperties": False,
    }


def schema_corpus(count: int = 320, seed: int = 0) -> list[Schema]:
    """`count` schemas: top-level objects (nested up to 3 levels), every 8th built on `$ref`."""
    rng = random.Random(seed)
    out: list[Schema] = []
    for i in range(count):
        depth = i % 4
        out.append(_with_ref(rng, depth) if i % 8 == 7 else _object(rng, depth))
    return out
