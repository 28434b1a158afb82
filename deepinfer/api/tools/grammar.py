"""Forced tool choice by constrained decoding: the grammar of an answer that is only calls.

The grammar spells exactly the text the tool format renders and the parser reads back
(`text/tools.py`: `<tool_call>`, `call_head(name)`, the arguments, `CALL_TAIL`, `</tool_call>`,
calls separated by `CALL_SEPARATOR`); markers the vocabulary holds as added tokens are those
tokens. Each tool is one alternative, its arguments one instance of its `parameters` schema
(compact JSON). One call without parallel calls, else one or more; the grammar ends after the
last call, so the answer ends there (end of turn) and its finish reason is `tool_calls`.

`auto` is never constrained, `strict: true` tools included: the model may answer in text, and a
call it writes is parsed as written (its arguments are not checked against the schema).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from deepinfer.api.tools.plan import ToolPlan, ToolSchema, invalid
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    CALL_TAIL,
    ToolFormat,
    call_head,
)

GRAMMAR_PARAM = "tool_choice"
"""The field a forced call's grammar is reported under."""
_COMPACT = {"whitespace_flexible": False}
"""Arguments as compact JSON: no unbounded runs of whitespace for a model to wander into."""


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _marker(fmt: ToolFormat, marker: str) -> str:
    token_id = fmt.marker_ids.get(marker)
    return _literal(marker) if token_id is None else f"<[{token_id}]>"


def _schema(tool: ToolSchema) -> str:
    """The tool's schema with compact JSON unless it sets its own `x-guidance` options."""
    schema: Any = json.loads(tool.parameters)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
    return json.dumps(schema, ensure_ascii=False)


def call_grammar(fmt: ToolFormat, tools: Sequence[ToolSchema], max_calls: int | None) -> str:
    """A Lark grammar (llguidance's dialect) of answers made of calls of `tools` only."""
    assert tools, "a forced choice has at least one tool"
    rules = [
        "start: call" if max_calls == 1 else f"start: call ({_literal(CALL_SEPARATOR)} call)*",
        "call: " + " | ".join(f"call_{k}" for k in range(len(tools))),
    ]
    open_, close = _marker(fmt, CALL_OPEN), _marker(fmt, CALL_CLOSE)
    for k, tool in enumerate(tools):
        head, tail = _literal(call_head(tool.name)), _literal(CALL_TAIL)
        rules.append(f"call_{k}: {open_} {head} %json {_schema(tool)} {tail} {close}")
    return "\n".join(rules) + "\n"


def schema_part(tool: ToolSchema) -> StructuredSpec:
    """A tool's schema as a piece of its call grammar: the engine checks it (in the grammar
    probe's child process, like every new grammar) and a refusal names `tool.param`."""
    return StructuredSpec(StructuredKind.JSON_SCHEMA, _schema(tool), tool.param)


def forced_calls(params: SamplingParams, plan: ToolPlan, fmt: ToolFormat | None) -> SamplingParams:
    """`params` constrained to the plan's forced calls (unchanged without a forced choice); 400
    when another constraint is set too, or a schema cannot be compiled."""
    if not plan.forced:
        return params
    if params.structured is not None:
        raise invalid(
            GRAMMAR_PARAM,
            f"a forced tool call conflicts with {params.structured.param}: set only one",
        )
    grammar = call_grammar(fmt or ToolFormat(), plan.forced, plan.max_calls)
    parts = tuple(schema_part(tool) for tool in plan.forced)
    spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, GRAMMAR_PARAM, parts)
    return dataclasses.replace(params, structured=spec)


def recipe_format(recipe: object) -> ToolFormat | None:
    """The recipe's tool format (recipes without one refuse tools when they encode)."""
    fmt = getattr(recipe, "tool_format", None)
    return fmt if isinstance(fmt, ToolFormat) else None
