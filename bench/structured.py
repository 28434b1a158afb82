"""Constrained decoding against unconstrained, one engine, the same requests.

Loads the default model with the default engine flags (`AsyncEngine(Config())`), then for each
stream count sends the same chat prompts three ways, one after another, `--repeats` times:
unconstrained (`ignore_eos`), constrained by a mid-size `json_schema` with the default fill
(beside the forward pass where a core is left for it, else after it), and constrained with the
fill always beside, and always after, the forward pass (the A/B of the overlap). The schema's shortest instance is longer than `--max-tokens`, so every request of
every run ends by length with the same number of tokens. With `--tools`, a fourth way: the
grammar a request with tools gets under `auto` (text, or calls once `<tool_call>` is written;
`api/tools/grammar.py`), on the same prompts, which answer in text (`ignore_eos`): what the
lazy call grammar costs a request that never calls. Also times schema compilation, cold (a new
schema each time) and cached.

    python bench/structured.py --streams 1 32 --max-tokens 96 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.api.tools.grammar import answer_constraint
from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.config import Config
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import FinishReason, SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.messages import ChatMessage

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "created": {"type": "string", "format": "date"},
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"year": {"type": "integer"}, "event": {"type": "string"}},
                "required": ["year", "event"],
                "additionalProperties": False,
            },
            "minItems": 12,
        },
    },
    "required": ["id", "name", "email", "active", "role", "score", "address", "tags", "created",
                 "history"],
    "additionalProperties": False,
}  # fmt: skip
"""Ten fields, a nested object, an enum, arrays; at least ~200 tokens in any instance."""
TOOLS = tuple(
    ToolSchema(name, json.dumps(schema), f"tools[{k}].function.parameters", strict=k == 0)
    for k, (name, schema) in enumerate([
        ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False}),
        ("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
        ("read_file", {"type": "object", "properties": {"path": {"type": "string"}}}),
    ])
)  # fmt: skip
"""Three tools, one strict: the grammar of `auto` calls of the `--tools` run."""
TOPICS = ["the ocean", "volcanoes", "a lighthouse", "bread", "the moon", "trains", "chess",
          "rain", "honeybees", "a library", "glaciers", "jazz", "bicycles", "deserts"]  # fmt: skip


@dataclass
class Run:
    label: str
    streams: int
    tokens: int
    wall_s: float
    decode_tok_s: float
    """Tokens after each stream's first, over the time from the last first token to the end."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def spec_of(schema: dict[str, Any]) -> StructuredSpec:
    return StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))


def set_overlap(engine: AsyncEngine, on: bool | None) -> bool:
    """Set the fill overlap on both runners (None: the default, where a core is left for the
    fill); False where the engine has none (older trees)."""
    runners = {id(r): r for r in (engine.core.runner, engine.core.decode_runner)}.values()
    masks = [getattr(r, "masks", None) for r in runners]
    for m in masks:
        if m is not None:
            m.overlap = on
    return all(m is not None for m in masks)


def compile_times(engine: AsyncEngine, count: int) -> dict[str, float]:
    compiler = engine.core.constraints
    start = time.perf_counter()
    compiler.compile(spec_of({"type": "integer"}))  # builds the library's tokenizer
    setup_s = time.perf_counter() - start
    cold, cached = [], []
    for i in range(count):  # a new cache key each time: one more enum value
        schema = copy.deepcopy(SCHEMA)
        schema["properties"]["role"]["enum"].append(f"role-{i}")
        start = time.perf_counter()
        compiler.compile(spec_of(schema))
        cold.append(time.perf_counter() - start)
    for _ in range(count):
        start = time.perf_counter()
        compiler.compile(spec_of(SCHEMA))
        cached.append(time.perf_counter() - start)
    return {"setup_s": setup_s, **pcts("cold", cold), **pcts("cached", cached)}


def pcts(name: str, xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return {f"{name}_p50_ms": statistics.median(xs) * 1e3, f"{name}_p99_ms": p99 * 1e3}


async def one_stream(
    engine: AsyncEngine, prompt: list[ChatMessage], params: SamplingParams
) -> tuple[int, float, float]:
    """(tokens, first-token time, end time)."""
    tokens, first, reason = 0, 0.0, None
    async for out in engine.generate(prompt, params):
        if tokens == 0 and out.token_ids:
            first = time.perf_counter()
        tokens += len(out.token_ids)
        reason = out.finish_reason
    assert reason is FinishReason.LENGTH, f"ended by {reason}: raise the schema's minimum"
    return tokens, first, time.perf_counter()


def tools_spec() -> StructuredSpec:
    spec = answer_constraint(SamplingParams(), ToolPlan(schemas=TOOLS), None).structured
    assert spec is not None
    return spec


async def run(
    engine: AsyncEngine, label: str, streams: int, max_tokens: int, constrained: str
) -> Run:
    """`constrained`: "" (none), "schema" or "tools"."""
    spec = {"": None, "schema": spec_of(SCHEMA), "tools": tools_spec()}[constrained]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=constrained != "schema",
        structured=spec,
    )
    prompts = [
        [ChatMessage("user", f"Make up a JSON record of a person who loves {TOPICS[i % 14]}.")]
        for i in range(streams)
    ]
    start = time.perf_counter()
    done = await asyncio.gather(*(one_stream(engine, p, params) for p in prompts))
    wall = time.perf_counter() - start
    tokens = sum(t for t, _, _ in done)
    assert tokens == streams * max_tokens
    last_first, end = max(f for _, f, _ in done), max(e for _, _, e in done)
    decode = (tokens - streams) / max(end - last_first, 1e-9)
    return Run(label, streams, tokens, wall, decode)


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    async with AsyncEngine(Config()) as engine:
        info = engine.core.info
        print(f"{info.model_name} on {info.device}, default flags, label {ns.label!r}")
        compiled = compile_times(engine, ns.compiles)
        print(json.dumps({k: round(v, 3) for k, v in compiled.items()}))
        has_overlap = set_overlap(engine, None)
        configs: list[tuple[str, str, bool | None]] = [
            ("unconstrained", "", None),
            ("constrained", "schema", None),
        ]
        if has_overlap:
            configs.append(("constrained, fill beside the forward pass", "schema", True))
            configs.append(("constrained, fill after forward", "schema", False))
        if ns.tools:
            configs.append(("auto tools grammar, text answers", "tools", None))
        results: list[dict[str, Any]] = []
        for streams in ns.streams:
            await run(engine, "warm-up", streams, 8, "")  # prompts into the prefix cache
            runs: dict[str, list[Run]] = {c[0]: [] for c in configs}
            for _ in range(ns.repeats):
                for label, constrained, overlap in configs:
                    set_overlap(engine, overlap)
                    runs[label].append(
                        await run(engine, label, streams, ns.max_tokens, constrained)
                    )
            set_overlap(engine, None)
            base = statistics.median(r.tok_s for r in runs["unconstrained"])
            for label, got in runs.items():
                tok_s = statistics.median(r.tok_s for r in got)
                decode = statistics.median(r.decode_tok_s for r in got)
                row = {"label": ns.label, "streams": streams, "run": label, "tok_s": tok_s,
                       "decode_tok_s": decode, "ratio": tok_s / base,
                       "all_tok_s": [round(r.tok_s, 1) for r in got]}  # fmt: skip
                results.append(row)
                print(
                    f"| {ns.label} | {streams} | {label} | {tok_s:.1f} | {decode:.1f} | "
                    f"{tok_s / base:.3f} | {row['all_tok_s']} |",
                    flush=True,
                )
        return {"compile": compiled, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compiles", type=int, default=100, help="schemas timed cold and cached")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--tools", action="store_true", help="also the `auto` tools grammar")
    parser.add_argument("--json", default=None, help="also write the figures here")
    ns = parser.parse_args()
    figures = asyncio.run(main_async(ns))
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
