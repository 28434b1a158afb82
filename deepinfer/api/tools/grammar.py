"""Tools and a response format as one constraint on the answer, by constrained decoding.

The calls' grammar spells exactly the text the family's tool format renders and the parser reads
back (its `CallMarkup`, `text/tool_markup.py`: e.g. Hermes' `<tool_call>`, `call_head(name)`,
the arguments, `CALL_TAIL`, `</tool_call>`, calls separated by `CALL_SEPARATOR`; Mistral's
`[TOOL_CALLS]` and a JSON list); markers the vocabulary holds as tokens are those tokens. Each
tool is one alternative, its arguments one instance of its `parameters` schema (compact JSON).
One call without parallel calls (or where the family writes one), else one or more; the grammar
ends after the last call, so the answer ends there (end of turn) and its finish reason is
`tool_calls`.

What applies, as OpenAI does it (`answer_constraint`):
- a forced choice (`required`, `any`, a named tool): the calls' grammar. A response format
  shapes a text answer, and a forced answer has none, so it is set aside (not a 400);
- `auto` with a response format: one grammar, either calls (arguments valid for their schemas)
  or a text answer matching the format (`%json`, a regex, a choice, or the client's grammar
  nested with `%lark`), so a tool stays callable;
- `auto` alone is not constrained, `strict: true` tools included: the model may answer in text,
  and a call it writes is parsed as written (its arguments are not checked against the schema);
- no tools (`none`, or none declared): the response format alone, if any.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import llguidance as llg

from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.tool_markup import CallMarkup, FamilyTools, Piece
from deepinfer.text.tools import ToolFormat

GRAMMAR_PARAM = "tool_choice"
"""The field a forced call's grammar is reported under."""
ANY_OBJECT = '{"type": "object"}'
"""The schema of `json_object`: any JSON object."""
_COMPACT = {"whitespace_flexible": False}
"""Arguments as compact JSON: no unbounded runs of whitespace for a model to wander into."""


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _pieces(pieces: Sequence[Piece]) -> str:
    """Text as Lark literals, token ids as llguidance's token terminals."""
    return " ".join(_literal(p) if isinstance(p, str) else f"<[{p}]>" for p in pieces if p != "")


def _compact(source: str) -> str:
    """A JSON schema with compact JSON unless it sets its own `x-guidance` options."""
    schema: Any = json.loads(source)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
    return json.dumps(schema, ensure_ascii=False)


def _call_rules(fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None) -> list[str]:
    """The rules of `calls`: one call of `tools` without parallel calls (or where the family
    writes one), else one or more, inside the family's prefix and suffix."""
    assert tools, "calls need at least one tool"
    markup: CallMarkup = fmt.markup
    if markup.max_calls is not None:
        max_calls = markup.max_calls if max_calls is None else min(max_calls, markup.max_calls)
    calls = "call" if max_calls == 1 else f"call ({_literal(markup.separator)} call)*"
    whole = [_pieces(markup.prefix), calls, _pieces(markup.suffix)]
    rules = [
        "calls: " + " ".join(p for p in whole if p),
        "call: " + " | ".join(f"call_{k}" for k in range(len(tools))),
    ]
    for k, tool in enumerate(tools):
        head = _literal(markup.head(tool.name))
        parts = [_pieces(markup.call_open), head, f"%json {_compact(tool.parameters)}"]
        parts.append(_pieces(markup.call_close))
        rules.append(f"call_{k}: " + " ".join(p for p in parts if p))
    return rules


def call_grammar(fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None) -> str:
    """A Lark grammar (llguidance's dialect) of answers made of calls of `tools` only."""
    return "\n".join(["start: calls", *_call_rules(fmt, tools, max_calls)]) + "\n"


def calls_or_text_grammar(
    fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None, text: StructuredSpec
) -> str:
    """A Lark grammar of answers that are either calls of `tools` or a text matching `text`."""
    rules = ["start: calls | text", f"text: {_text_rule(text)}"]
    return "\n".join([*rules, *_call_rules(fmt, tools, max_calls)]) + "\n"


def _text_rule(spec: StructuredSpec) -> str:
    """The body of a Lark rule matching exactly what `spec` alone accepts."""
    if spec.kind is StructuredKind.JSON_SCHEMA:
        return f"%json {_compact(spec.source)}"
    if spec.kind is StructuredKind.JSON_OBJECT:
        return f"%json {_compact(ANY_OBJECT)}"
    if spec.kind is StructuredKind.REGEX:
        return f"/{llg.regex_to_lark(spec.source, '')}/"
    if spec.kind is StructuredKind.CHOICE:
        return " | ".join(_literal(choice) for choice in json.loads(spec.source))
    return f"%lark {{\n{spec.source}\n}}"


def schema_part(tool: ToolSchema) -> StructuredSpec:
    """A tool's schema as a piece of its call grammar: the engine checks it (in the grammar
    probe's child process, like every new grammar) and a refusal names `tool.param`."""
    return StructuredSpec(StructuredKind.JSON_SCHEMA, _compact(tool.parameters), tool.param)


def answer_constraint(
    params: SamplingParams, plan: ToolPlan, fmt: FamilyTools | None
) -> SamplingParams:
    """`params` for the plan's tools: the control tokens the call parser reads shown in the
    text, and the one constraint the plan's tools and its response format (`structured`) make
    together (see the module's docstring); unchanged without tools. A schema that cannot be
    compiled is refused at submit, naming its field."""
    fmt = fmt or ToolFormat()
    if plan.parses_calls and fmt.markup.shown_ids:
        params = dataclasses.replace(params, shown_token_ids=fmt.markup.shown_ids)
    text = params.structured
    if not plan.forced and (text is None or not plan.schemas):
        return params
    if plan.forced:
        grammar = call_grammar(fmt, plan.forced, plan.max_calls)
        parts = tuple(schema_part(tool) for tool in plan.forced)
        spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, GRAMMAR_PARAM, parts)
    else:
        assert text is not None
        grammar = calls_or_text_grammar(fmt, plan.schemas, plan.max_calls, text)
        parts = (*(schema_part(tool) for tool in plan.schemas), text)
        spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, text.param, parts)
    return dataclasses.replace(params, structured=spec)


def recipe_format(recipe: object) -> FamilyTools | None:
    """The recipe's tool format (recipes without one refuse tools when they encode)."""
    fmt = getattr(recipe, "tool_format", None)
    return fmt if isinstance(fmt, FamilyTools) else None
