"""Forced tool choice by constrained decoding: the grammar of an answer that is only calls.

The grammar spells exactly the text the family's tool format renders and the parser reads back
(its `CallMarkup`, `text/tool_markup.py`: e.g. Hermes' `<tool_call>`, `call_head(name)`, the
arguments, `CALL_TAIL`, `</tool_call>`, calls separated by `CALL_SEPARATOR`; Mistral's
`[TOOL_CALLS]` and a JSON list); markers the vocabulary holds as tokens are those tokens. Each
tool is one alternative, its arguments one instance of its `parameters` schema (compact JSON).
One call without parallel calls (or where the family writes one), else one or more; the grammar
ends after the last call, so the answer ends there (end of turn) and its finish reason is
`tool_calls`.

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
from deepinfer.text.tool_markup import CallMarkup, FamilyTools, Piece
from deepinfer.text.tools import ToolFormat

GRAMMAR_PARAM = "tool_choice"
"""The field a forced call's grammar is reported under."""
_COMPACT = {"whitespace_flexible": False}
"""Arguments as compact JSON: no unbounded runs of whitespace for a model to wander into."""


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _pieces(pieces: Sequence[Piece]) -> str:
    """Text as Lark literals, token ids as llguidance's token terminals."""
    return " ".join(_literal(p) if isinstance(p, str) else f"<[{p}]>" for p in pieces if p != "")


def _schema(tool: ToolSchema) -> str:
    """The tool's schema with compact JSON unless it sets its own `x-guidance` options."""
    schema: Any = json.loads(tool.parameters)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
    return json.dumps(schema, ensure_ascii=False)


def call_grammar(fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None) -> str:
    """A Lark grammar (llguidance's dialect) of answers made of calls of `tools` only."""
    assert tools, "a forced choice has at least one tool"
    markup: CallMarkup = fmt.markup
    if markup.max_calls is not None:
        max_calls = markup.max_calls if max_calls is None else min(max_calls, markup.max_calls)
    calls = "call" if max_calls == 1 else f"call ({_literal(markup.separator)} call)*"
    start = [_pieces(markup.prefix), calls, _pieces(markup.suffix)]
    rules = [
        "start: " + " ".join(p for p in start if p),
        "call: " + " | ".join(f"call_{k}" for k in range(len(tools))),
    ]
    for k, tool in enumerate(tools):
        head = _literal(markup.head(tool.name))
        parts = [_pieces(markup.call_open), head, f"%json {_schema(tool)}"]
        parts.append(_pieces(markup.call_close))
        rules.append(f"call_{k}: " + " ".join(p for p in parts if p))
    return "\n".join(rules) + "\n"


def schema_part(tool: ToolSchema) -> StructuredSpec:
    """A tool's schema as a piece of its call grammar: the engine checks it (in the grammar
    probe's child process, like every new grammar) and a refusal names `tool.param`."""
    return StructuredSpec(StructuredKind.JSON_SCHEMA, _schema(tool), tool.param)


def forced_calls(params: SamplingParams, plan: ToolPlan, fmt: FamilyTools | None) -> SamplingParams:
    """`params` for the plan's tools: the control tokens the call parser reads shown in the
    text, and constrained to the plan's forced calls (none without a forced choice); 400 when
    another constraint is set too, or a schema cannot be compiled."""
    fmt = fmt or ToolFormat()
    if plan.parses_calls and fmt.markup.shown_ids:
        params = dataclasses.replace(params, shown_token_ids=fmt.markup.shown_ids)
    if not plan.forced:
        return params
    if params.structured is not None:
        raise invalid(
            GRAMMAR_PARAM,
            f"a forced tool call conflicts with {params.structured.param}: set only one",
        )
    grammar = call_grammar(fmt, plan.forced, plan.max_calls)
    parts = tuple(schema_part(tool) for tool in plan.forced)
    spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, GRAMMAR_PARAM, parts)
    return dataclasses.replace(params, structured=spec)


def recipe_format(recipe: object) -> FamilyTools | None:
    """The recipe's tool format (recipes without one refuse tools when they encode)."""
    fmt = getattr(recipe, "tool_format", None)
    return fmt if isinstance(fmt, FamilyTools) else None
