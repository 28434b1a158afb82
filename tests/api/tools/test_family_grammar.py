"""Forced calls in Mistral's and Llama 3.1's markup: the grammar accepts the calls its family's
markup spells, with the control tokens as those tokens, and nothing else; what it accepts
decodes (control tokens shown) and parses back to the same calls. Under `auto`: text, or text
then calls once the family's opener (its control token, or Llama's `{` at the start) is written.

Vocabularies: SmolLM2's with the family's control tokens added, as in the recipe tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from deepinfer.api.tools.grammar import (
    answer_constraint,
    auto_grammar,
    call_grammar,
    recipe_format,
)
from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher
from deepinfer.sampling.vocabulary import vocabulary_from
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.messages import ToolSpec
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tool_markup import CallMarkup, FamilyTools
from deepinfer.text.tool_parser import parse_answer
from tests.text.test_recipe_families import write_tokenizer_gguf
from tests.text.test_recipe_family_tools import FAMILIES

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TZ = {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}
TOOLS = (
    ToolSchema("get_weather", json.dumps(CITY), "tools[0].function.parameters"),
    ToolSchema("get_time", json.dumps(TZ), "tools[1].function.parameters"),
)
WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"tz": 2}')


@pytest.fixture(scope="module", params=["mistral", "llama3.1"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    template, controls, bos, eos, user = FAMILIES[name]
    path = Path(tmp_path_factory.mktemp("grammar")) / f"{name}.gguf"
    write_tokenizer_gguf(path, open_gguf(default_model_path()), template, controls, bos, eos, user)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    fmt = recipe_format(recipe_for(tok))
    assert fmt is not None
    assert tok.eos_token_id is not None
    compiler = ConstraintCompiler(lambda: vocabulary_from(tok, tok.eos_token_id or 0))
    return name, tok, fmt, compiler


def answer_ids(tok: Tokenizer, markup: CallMarkup, calls: list[tuple[str, str]]) -> list[int]:
    """An answer of `calls` as the markup spells it: control tokens as ids, text encoded."""
    pieces: list[str | int] = [*markup.prefix]
    for k, (name, args) in enumerate(calls):
        if k:
            pieces.append(markup.separator)
        pieces += [*markup.call_open, markup.head(name) + args, *markup.call_close]
    pieces += markup.suffix
    ids: list[int] = []
    text = ""
    for p in [*pieces, 0]:  # 0: a sentinel that flushes the last text
        if isinstance(p, str):
            text += p
            continue
        ids += tok.encode(text) if text else []
        text = ""
        ids += [p] if p else []
    return ids


def allowed(matcher: ConstraintMatcher, tok: Tokenizer, stops: frozenset[int]) -> set[int]:
    row = np.zeros(-(-tok.vocab_size // 32), dtype=np.int32)
    matcher.fill(row, stops)
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def accepts(family: Any, max_calls: int | None, ids: list[int], auto: bool = False) -> bool:
    _, tok, fmt, compiler = family
    stops = frozenset({tok.eos_token_id})
    grammar = (auto_grammar if auto else call_grammar)(fmt, TOOLS, max_calls)
    matcher = compiler.matcher(StructuredSpec(StructuredKind.GRAMMAR, grammar, "tool_choice"))
    for token_id in ids:
        if token_id not in allowed(matcher, tok, stops):
            return False
        matcher.accept(token_id, stops)
    return matcher.is_accepting and allowed(matcher, tok, stops) >= stops


def decoded(tok: Tokenizer, fmt: FamilyTools, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, shown_ids=frozenset(fmt.markup.shown_ids))
    return detok.push(ids) + detok.flush()


@pytest.mark.slow
def test_grammar_accepts_calls_that_parse_back(family: Any) -> None:
    name, tok, fmt, _ = family
    cases = [([WEATHER], 1)] + ([([WEATHER, TIME, WEATHER], None)] if name == "mistral" else [])
    for calls, max_calls in cases:
        ids = answer_ids(tok, fmt.markup, calls)
        assert any(i in tok.special_token_ids for i in ids) == (name == "mistral")
        assert accepts(family, max_calls, ids)
        answer = parse_answer(decoded(tok, fmt, ids), markup=fmt.markup)
        assert answer.content == "" and [(c.name, c.arguments) for c in answer.calls] == calls


@pytest.mark.slow
def test_grammar_refuses_anything_else(family: Any) -> None:
    name, tok, fmt, _ = family
    markup = fmt.markup
    wrong = [
        answer_ids(tok, markup, [("get_date", '{"city": "P"}')]),
        answer_ids(tok, markup, [("get_weather", '{"town": "P"}')]),
        tok.encode("Sure! ") + answer_ids(tok, markup, [WEATHER]),
        answer_ids(tok, markup, [WEATHER, WEATHER]),  # one call at most (max_calls 1)
    ]
    if name == "mistral":  # the marker typed as text is not the marker
        wrong.append(
            tok.encode('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P"}}]')
        )
    for ids in wrong:
        assert not accepts(family, 1, ids)


def test_answer_constraint_shows_the_markers_the_parser_reads(family: Any) -> None:
    _, _, fmt, _ = family
    plan = ToolPlan(specs=(), forced=TOOLS[:1], max_calls=1)
    assert answer_constraint(SamplingParams(), plan, fmt).shown_token_ids == ()  # parses nothing
    spec = ToolSpec("get_weather", "{}")
    params = answer_constraint(SamplingParams(), ToolPlan(specs=(spec,)), fmt)
    assert params.shown_token_ids == fmt.markup.shown_ids and len(params.shown_token_ids) == 1
    assert params.structured is None


@pytest.mark.slow
def test_auto_is_text_or_calls_once_opened(family: Any) -> None:
    name, tok, fmt, _ = family
    markup = fmt.markup
    text = tok.encode("It is sunny in Paris.")
    calls = answer_ids(tok, markup, [WEATHER])
    opened = (
        [*text, *calls]
        if name == "mistral"  # the calls' own control token opens them
        else [*text, markup.shown_ids[0], *calls]  # Llama: after <|python_tag|>
    )
    for ids in (text, [], opened, calls if name != "mistral" else opened):
        assert accepts(family, None, ids, auto=True), tok.decode(ids)
    answer = parse_answer(decoded(tok, fmt, opened), markup=fmt.markup)
    assert answer.content == "It is sunny in Paris." and len(answer.calls) == 1
    bad_name = answer_ids(tok, markup, [("get_date", '{"city": "P"}')])
    wrong = [
        [*opened, *tok.encode(" More text.")],  # the answer ends after its calls
        [*opened[: len(opened) - len(calls)], *bad_name],
        [*text, *tok.encode(" "), markup.shown_ids[0], *tok.encode("Sure")],
    ]
    if name != "mistral":  # an answer that begins with `{` is a call
        wrong += [bad_name, tok.encode('{"answer": 1}')]
    for ids in wrong:
        assert not accepts(family, None, ids, auto=True), tok.decode(ids)


@pytest.mark.slow
def test_auto_reads_hermes_markers_held_as_tokens(tmp_path: Path) -> None:
    """Qwen3's vocabulary holds `<tool_call>` and `</tool_call>` as added tokens (not control
    tokens): under `auto` the marker token opens a call as its text does, and the call ends with
    the closing marker's token."""
    template, controls, bos, eos, user = FAMILIES["qwen3"]
    path = tmp_path / "qwen3.gguf"
    write_tokenizer_gguf(path, open_gguf(default_model_path()), template, controls, bos, eos, user)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    fmt = recipe_format(recipe_for(tok))
    assert fmt is not None and tok.eos_token_id is not None
    markup = fmt.markup
    open_id, close_id = markup.call_open[0], markup.call_close[-1]
    assert isinstance(open_id, int) and isinstance(close_id, int)
    family = (
        "qwen3",
        tok,
        fmt,
        ConstraintCompiler(lambda: vocabulary_from(tok, tok.eos_token_id or 0)),
    )
    text = tok.encode("Let me check.")
    calls = answer_ids(tok, markup, [WEATHER, TIME])
    assert calls[0] == open_id and close_id in calls
    assert accepts(family, None, text, auto=True)
    assert accepts(family, None, [*text, *calls], auto=True)
    assert (
        parse_answer(decoded(tok, fmt, [*text, *calls]), markup=markup).calls[1].name == "get_time"
    )
    for ids in (
        [*text, open_id, *tok.encode("I will call get_weather.")],
        [*text, *calls, *tok.encode("Done.")],
        [*text, *answer_ids(tok, markup, [("get_date", "{}")])],
    ):
        assert not accepts(family, None, ids, auto=True), tok.decode(ids)
