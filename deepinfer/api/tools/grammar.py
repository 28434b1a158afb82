"""Tools and a response format as one constraint on the answer, by constrained decoding.

The calls' grammar spells exactly the text the family's tool format renders and the parser reads
back (its `CallMarkup`, `text/tool_markup.py`: e.g. Hermes' `<tool_call>`, `call_head(name)`,
the arguments, `CALL_TAIL`, `</tool_call>`, calls separated by `CALL_SEPARATOR`; Mistral's
`[TOOL_CALLS]` and a JSON list); markers the vocabulary holds as tokens are those tokens. Each
tool is one alternative, its arguments one instance of its `parameters` schema, spelled as the
recipe renders arguments in the history (`json.dumps`'s `", "` and `": "`, no other whitespace).
One call without parallel calls (or where the family writes one), else one or more; the grammar
ends after the last call, so the answer ends there (end of turn) and its finish reason is
`tool_calls`.

What applies, as OpenAI does it (`answer_constraint`):
- a forced choice (`required`, `any`, a named tool): the calls' grammar. A response format
  shapes a text answer, and a forced answer has none, so it is set aside (not a 400);
- `auto` with a response format: one grammar, either calls (arguments valid for their schemas)
  or a text answer matching the format (`%json`, a regex, a choice, or the client's grammar
  nested with `%lark`), so a tool stays callable;
- `auto` alone: the model may answer in text, and once it opens a call (the family's opener:
  Hermes' `<tool_call>` as text or token, Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>` or
  a `{` that begins the answer) the rest is calls, as forced ones are written: a declared tool's
  name, arguments that are a JSON object (valid for the tool's schema where the tool says
  `strict: true`), and the answer ends after the last call. The text before is free (a lazy
  lexeme up to the opener, llguidance's tool-calling pattern), so a call the model writes is
  always one the parser reads back and a client can parse: llama.cpp's lazy grammars, OpenAI's
  strict tools;
- no tools (`none`, or none declared): the response format alone, if any.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance as llg

from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.detokenizer import CONTROL_MARK
from deepinfer.text.tool_markup import CallMarkup, FamilyTools, Piece
from deepinfer.text.tools import ToolFormat

GRAMMAR_PARAM = "tool_choice"
"""The field a forced call's grammar is reported under."""
AUTO_PARAM = "tools"
"""The field the grammar of `auto` calls is reported under."""
ANY_OBJECT = '{"type": "object"}'
"""The schema of `json_object`: any JSON object."""
_COMPACT: Mapping[str, object] = {"whitespace_flexible": False}
"""A text format's JSON compact: no unbounded runs of whitespace for a model to wander into."""
_AS_RENDERED: Mapping[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""Call arguments spelled as the recipe renders a call in the history (`arguments_json`, a chat
template's `tojson`): no runs of whitespace either, and the call the model writes is the text
the next turn renders, so an agent's next request reuses the cached prefix through it."""


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _pieces(pieces: Sequence[Piece]) -> str:
    """Text as Lark literals, token ids as llguidance's token terminals."""
    return " ".join(_literal(p) if isinstance(p, str) else f"<[{p}]>" for p in pieces if p != "")


def _compact(source: str, options: Mapping[str, object] = _COMPACT) -> str:
    """A JSON schema with llguidance's JSON `options` (compact JSON by default) unless it sets
    its own `x-guidance` ones."""
    schema: Any = json.loads(source)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
    return json.dumps(schema, ensure_ascii=False)


def _call_rules(
    fmt: FamilyTools,
    tools: Sequence[ToolSchema],
    max_calls: int | None,
    opened: bool = False,
    strict_only: bool = False,
) -> list[str]:
    """The rules of `calls`: one call of `tools` without parallel calls (or where the family
    writes one), else one or more, inside the family's prefix and suffix. `opened`: the first
    call's opener is already read (a lazy lead ended with it), so `calls` starts after it.
    `strict_only`: only `strict` tools' arguments follow their schema, the others' are a JSON
    object (`auto`); else every tool's schema applies (a forced choice)."""
    assert tools, "calls need at least one tool"
    markup: CallMarkup = fmt.markup
    if markup.max_calls is not None:
        max_calls = markup.max_calls if max_calls is None else min(max_calls, markup.max_calls)
    first = "body" if opened else "call"
    calls = first if max_calls == 1 else f"{first} ({_literal(markup.separator)} call)*"
    whole = [_pieces(() if opened else markup.prefix), calls, _pieces(markup.suffix)]
    rules = [
        "calls: " + " ".join(p for p in whole if p),
        "call: " + " | ".join(f"call_{k}" for k in range(len(tools))),
    ]
    if opened:
        rules.append("body: " + " | ".join(f"body_{k}" for k in range(len(tools))))
    call_open = _pieces(markup.call_open)
    for k, tool in enumerate(tools):
        schema = tool.parameters if tool.strict or not strict_only else ANY_OBJECT
        body = [_literal(markup.head(tool.name)), f"%json {_compact(schema, _AS_RENDERED)}"]
        body.append(_pieces(markup.call_close))
        rules.append(f"call_{k}: " + " ".join(p for p in (call_open, f"body_{k}") if p))
        rules.append(f"body_{k}: " + " ".join(p for p in body if p))
    return rules


def call_grammar(fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None) -> str:
    """A Lark grammar (llguidance's dialect) of answers made of calls of `tools` only."""
    return "\n".join(["start: calls", *_call_rules(fmt, tools, max_calls)]) + "\n"


def auto_grammar(fmt: FamilyTools, tools: Sequence[ToolSchema], max_calls: int | None) -> str:
    """A Lark grammar of `auto` answers: free text, or free text then calls of `tools` once the
    family's opener is written (see the module docstring)."""
    markup = fmt.markup
    text = "TEXT_NOT_CALL" if markup.bare_start else "TEXT"
    rules = ["TEXT_NOT_CALL: /\\s*([^\\s{](.|\\n)*)?/" if markup.bare_start else "TEXT: /(.|\\n)*/"]
    alternatives = [text]
    opened = False
    if markup.opener == CONTROL_MARK:  # a control token no text can spell opens the calls
        tag = markup.shown_ids[0]
        entry = (*markup.prefix, *markup.call_open)[:1]
        opens = "calls" if entry == (tag,) else f"<[{tag}]> calls"
        alternatives.append(f"{text} {opens}")
    elif markup.opener:  # text (or an added token spelling it) opens the first call
        assert not markup.prefix, "a text opener opens the first call"
        rules.append(f"lead[lazy]: /(.|\\n)*/ {_literal(markup.opener)}")
        alternatives.append("lead calls")
        opened = True
    if markup.bare_start:  # an answer that begins with a call object is a call
        rules.append("WS: /\\s+/")
        alternatives += ["calls", "WS calls"]
    start = "start: " + " | ".join(alternatives)
    calls = _call_rules(fmt, tools, max_calls, opened=opened, strict_only=True)
    return "\n".join([start, *rules, *calls]) + "\n"


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
    source = _compact(tool.parameters, _AS_RENDERED)
    return StructuredSpec(StructuredKind.JSON_SCHEMA, source, tool.param)


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
    if not plan.forced and not plan.schemas:
        return params
    if plan.forced:
        grammar = call_grammar(fmt, plan.forced, plan.max_calls)
        parts = tuple(schema_part(tool) for tool in plan.forced)
        spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, GRAMMAR_PARAM, parts)
    elif text is None:
        grammar = auto_grammar(fmt, plan.schemas, plan.max_calls)
        parts = tuple(schema_part(tool) for tool in plan.schemas if tool.strict)
        spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, AUTO_PARAM, parts)
    else:
        grammar = calls_or_text_grammar(fmt, plan.schemas, plan.max_calls, text)
        parts = (*(schema_part(tool) for tool in plan.schemas), text)
        spec = StructuredSpec(StructuredKind.GRAMMAR, grammar, text.param, parts)
    return dataclasses.replace(params, structured=spec)


def recipe_format(recipe: object) -> FamilyTools | None:
    """The recipe's tool format (recipes without one refuse tools when they encode)."""
    fmt = getattr(recipe, "tool_format", None)
    return fmt if isinstance(fmt, FamilyTools) else None
