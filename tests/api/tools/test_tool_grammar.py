"""The call grammars on SmolLM2's real vocabulary: the forced one accepts exactly the text the
tool format renders and the parser reads back, and refuses other names, bad arguments and text;
under `auto` beside a response format, calls or a text the format alone accepts (as llguidance
compiles the format on its own)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from deepinfer.api.tools.grammar import (
    answer_constraint,
    auto_grammar,
    call_grammar,
    calls_or_text_grammar,
)
from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.environment import default_model_path
from deepinfer.errors import InvalidRequestError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher
from deepinfer.sampling.vocabulary import vocabulary_from
from deepinfer.text.messages import ChatMessage, ToolCall
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tool_parser import parse_answer
from deepinfer.text.tools import ToolFormat

STOPS = frozenset({2})
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TZ = {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}
TOOLS = (
    ToolSchema("get_weather", json.dumps(CITY), "tools[0].function.parameters"),
    ToolSchema('odd "name" <tool_call>', json.dumps(TZ), "tools[1].function.parameters"),
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2))


def rendered(*calls: ToolCall) -> str:
    """An answer as the tool format writes an assistant turn with these calls (less `role`)."""
    (pieces,) = ToolFormat().render(None, [ChatMessage("assistant", "", tool_calls=calls)], [])
    text = "".join(p for p in pieces if isinstance(p, str))
    return text.removeprefix("assistant\n")


def allowed(matcher: ConstraintMatcher, tokenizer: Tokenizer) -> set[int]:
    row = np.zeros(-(-tokenizer.vocab_size // 32), dtype=np.int32)
    matcher.fill(row, STOPS)
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def accepts(matcher: ConstraintMatcher, tokenizer: Tokenizer, text: str) -> bool:
    """Whether `text` is a complete answer of the grammar (it may end there), every token
    allowed on the way."""
    for token_id in tokenizer.encode(text):
        if token_id not in allowed(matcher, tokenizer):
            return False
        matcher.accept(token_id, STOPS)
    return matcher.is_accepting and allowed(matcher, tokenizer) >= STOPS


def grammar_matcher(compiler: ConstraintCompiler, max_calls: int | None) -> ConstraintMatcher:
    grammar = call_grammar(ToolFormat(), TOOLS, max_calls)
    return compiler.matcher(StructuredSpec(StructuredKind.GRAMMAR, grammar, "tool_choice"))


def test_grammar_accepts_rendered_calls_that_parse_back(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    one = ToolCall("get_weather", '{"city": "Paris"}')
    two = ToolCall(TOOLS[1].name, '{"tz": 2}')
    for calls, max_calls in (((one,), 1), ((one, two, one), None)):
        text = rendered(*calls)
        matcher = grammar_matcher(compiler, max_calls)
        assert accepts(matcher, tokenizer, text)
        if max_calls == 1:  # the answer ends after its one call
            assert allowed(matcher, tokenizer) == STOPS
        answer = parse_answer(text)
        assert answer.content == ""
        assert [(c.name, c.arguments) for c in answer.calls] == [
            (c.name, c.arguments) for c in calls
        ]


@pytest.mark.parametrize(
    ("text", "max_calls"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"city": "P"}}\n</tool_call>', None),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"town": "P"}}\n</tool_call>', None),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>', None),
        ('Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>', None),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "O"}}\n</tool_call>', 1),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call> ok', None),
    ],
)  # fmt: skip
def test_grammar_refuses_anything_else(
    compiler: ConstraintCompiler, tokenizer: Tokenizer, text: str, max_calls: int | None
) -> None:
    assert not accepts(grammar_matcher(compiler, max_calls), tokenizer, text)


def test_markers_held_as_tokens_are_spelled_as_those_tokens() -> None:
    fmt = ToolFormat().with_marker_ids({"<tool_call>": 7, "</tool_call>": 8})
    grammar = call_grammar(fmt, TOOLS[:1], 1)
    assert "<[7]>" in grammar and "<[8]>" in grammar and '"<tool_call>"' not in grammar


def test_schema_the_library_refuses_names_its_field(compiler: ConstraintCompiler) -> None:
    """Each forced tool's schema is a part of the call grammar, probed on its own first."""
    bad = ToolSchema("f", json.dumps({"type": "frobnicate"}), "tools[3].function.parameters")
    spec = answer_constraint(SamplingParams(), ToolPlan(forced=(TOOLS[0], bad)), None).structured
    assert spec is not None
    assert [part.param for part in spec.parts] == [TOOLS[0].param, bad.param]
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == "tools[3].function.parameters" and "frobnicate" in str(info.value)


FORMAT = StructuredSpec(
    StructuredKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {"answer": {"type": "string"}},
                "required": ["answer"], "additionalProperties": False}),
    "response_format.json_schema.schema",
)  # fmt: skip
AUTO = ToolPlan(max_calls=None, schemas=TOOLS)


def test_each_choice_and_format_make_one_constraint() -> None:
    """Forced: the calls only (a format has no text answer to shape); auto: calls or the
    format; auto alone and no tools: as the request asked."""
    with_format = SamplingParams(structured=FORMAT)
    forced = ToolPlan(max_calls=1, forced=TOOLS[:1], schemas=TOOLS)
    spec = answer_constraint(with_format, forced, None).structured
    assert spec is not None and spec.kind is StructuredKind.GRAMMAR and spec.param == "tool_choice"
    assert spec.source == call_grammar(ToolFormat(), TOOLS[:1], 1)
    assert [part.param for part in spec.parts] == [TOOLS[0].param]
    spec = answer_constraint(with_format, AUTO, None).structured
    assert spec is not None and spec.kind is StructuredKind.GRAMMAR
    assert spec.source == calls_or_text_grammar(ToolFormat(), TOOLS, None, FORMAT)
    assert spec.param == FORMAT.param and spec.parts[-1] == FORMAT
    assert [part.param for part in spec.parts[:-1]] == [t.param for t in TOOLS]
    spec = answer_constraint(SamplingParams(), AUTO, None).structured
    assert spec is not None and spec.source == auto_grammar(ToolFormat(), TOOLS, None)
    assert spec.param == "tools" and spec.parts == ()  # no tool is strict
    strict = ToolPlan(schemas=(TOOLS[0], dataclasses.replace(TOOLS[1], strict=True)))
    spec = answer_constraint(SamplingParams(), strict, None).structured
    assert spec is not None and [part.param for part in spec.parts] == [TOOLS[1].param]
    assert answer_constraint(with_format, ToolPlan(), None) == with_format


def auto_matcher(compiler: ConstraintCompiler, text: StructuredSpec) -> ConstraintMatcher:
    spec = answer_constraint(SamplingParams(structured=text), AUTO, None).structured
    assert spec is not None
    compiler.compile(spec)
    return compiler.matcher(spec)


def test_auto_with_a_format_is_a_call_or_the_format(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    one = rendered(ToolCall("get_weather", '{"city": "Paris"}'))
    two = rendered(
        ToolCall("get_weather", '{"city": "Paris"}'), ToolCall(TOOLS[1].name, '{"tz": 1}')
    )
    for text in (one, two, '{"answer":"Paris"}'):
        assert accepts(auto_matcher(compiler, FORMAT), tokenizer, text), text
    for text in (
        '{"answer":3}',
        '{"city":"Paris"}',
        "It is sunny.",
        one.replace('"Paris"', "3"),
        one + '{"answer":"Paris"}',
        '{"answer":"Paris"}' + one,
    ):
        assert not accepts(auto_matcher(compiler, FORMAT), tokenizer, text), text


TEXT_FORMATS = [
    (StructuredSpec(StructuredKind.JSON_OBJECT, "", "response_format"),
     ['{"a":1}', "{}", '{"a": 1}', "[1]", '"a"', "text"]),
    (StructuredSpec(StructuredKind.REGEX, r"(yes|no)/[0-9]{2}\n", "guided_regex"),
     ["yes/12\n", "no/07\n", "yes/1\n", "maybe/12\n", "yes/12"]),
    (StructuredSpec(StructuredKind.CHOICE, json.dumps(["red", 'say "}"']), "guided_choice"),
     ["red", 'say "}"', "blue", "re"]),
    (StructuredSpec(StructuredKind.GRAMMAR,
                    'start: "{" n ("," n)* "}"\nn: /[0-9]+/  // a } in a comment\n',
                    "structured_outputs.grammar"),
     ["{1,22}", "{7}", "{}", "{1,}", "1"]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "samples"), TEXT_FORMATS, ids=lambda v: getattr(v, "param", ""))
def test_the_text_branch_accepts_what_the_format_alone_does(
    compiler: ConstraintCompiler, tokenizer: Tokenizer, text: StructuredSpec, samples: list[str]
) -> None:
    verdicts = [accepts(compiler.matcher(text), tokenizer, sample) for sample in samples]
    assert any(verdicts) and not all(verdicts)
    assert [accepts(auto_matcher(compiler, text), tokenizer, s) for s in samples] == verdicts
    call = rendered(ToolCall("get_weather", '{"city": "Oslo"}'))
    assert accepts(auto_matcher(compiler, text), tokenizer, call)


def test_a_format_the_library_refuses_names_its_field(compiler: ConstraintCompiler) -> None:
    bad = StructuredSpec(StructuredKind.REGEX, "(unclosed", "guided_regex")
    spec = answer_constraint(SamplingParams(structured=bad), AUTO, None).structured
    assert spec is not None
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == "guided_regex"


STRICT_TIME = dataclasses.replace(TOOLS[1], strict=True)


def auto_alone(
    compiler: ConstraintCompiler, fmt: ToolFormat, max_calls: int | None
) -> ConstraintMatcher:
    spec = answer_constraint(
        SamplingParams(), ToolPlan(max_calls=max_calls, schemas=(TOOLS[0], STRICT_TIME)), fmt
    )
    assert spec.structured is not None
    compiler.compile(spec.structured)
    return compiler.matcher(spec.structured)


def test_auto_is_text_then_calls_once_opened(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    """Under `auto` alone: any text, and once `<tool_call>` is written, calls of declared tools
    (a strict tool's arguments valid for its schema, the others' any JSON object) that end the
    answer (`test_family_grammar.py`: the markers as tokens, as Qwen's vocabulary holds them)."""
    fmt = ToolFormat()
    weather = rendered(ToolCall("get_weather", '{"town": ["any", "object"]}'))
    time = rendered(ToolCall(STRICT_TIME.name, '{"tz": 2}'))
    good = [
        "It is sunny.",
        "",
        "Let me look. " + weather,
        weather + "\n" + time,
        "<tool_ca",
        "a < b and <tool> is not a call",
    ]
    bad = [
        weather + " And more text.",
        weather + "\n" + time,  # (max_calls 1)
        'Sure <tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>',
        time.replace('{"tz": 2}', '{"tz": "two"}'),  # the strict tool's schema holds
        weather.replace('": [', '":['),  # spelled otherwise than the history renders it
        "<tool_call>\nI will call it",
        '<tool_call>\n{"name": "get_weather", "arguments": {"type": "summer}", "q": {Tag',
    ]
    for text in good:
        assert accepts(auto_alone(compiler, fmt, None), tokenizer, text), text
    for k, text in enumerate(bad):
        assert not accepts(auto_alone(compiler, fmt, 1 if k == 1 else None), tokenizer, text), text
