"""The compiler and matcher on SmolLM2's real vocabulary: each kind of spec, refusals naming
the field, stop tokens once the grammar ends, and catching up with a request's outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer.environment import default_model_path
from deepinfer.errors import InvalidRequestError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import StructuredKind, StructuredSpec
from deepinfer.sampling.constraints import ConstraintCompiler, ConstraintMatcher
from deepinfer.sampling.vocabulary import vocabulary_from
from deepinfer.text.tokenizer import Tokenizer

STOPS = frozenset({2, 0})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2))


def _allowed(matcher: ConstraintMatcher, size: int) -> set[int]:
    row = np.zeros(-(-size // 32), dtype=np.int32)
    matcher.fill(row, STOPS)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def _drive(matcher: ConstraintMatcher, tokenizer: Tokenizer, text: str) -> None:
    """Feed `text` one token at a time, checking each was allowed."""
    for token_id in tokenizer.encode(text):
        assert token_id in _allowed(matcher, tokenizer.vocab_size)
        matcher.accept(token_id, STOPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "source", "text"),
    [
        (StructuredKind.JSON_SCHEMA, json.dumps({"type": "integer", "maximum": 99}), "42"),
        (StructuredKind.JSON_OBJECT, "", '{"a":[1,"x"]}'),
        (StructuredKind.REGEX, r"[a-c]{3}-\d", "abc-7"),
        (StructuredKind.CHOICE, json.dumps(["yes", "no way"]), "no way"),
        (
            StructuredKind.GRAMMAR,
            'start: "<tool_call>" %json {"type": "object", "properties": {"x": '
            '{"type": "integer"}}, "required": ["x"], "additionalProperties": false} "</tool_call>"',
            '<tool_call>{"x":5}</tool_call>',
        ),
    ],
)
def test_each_kind_ends_with_only_stop_tokens(
    compiler: ConstraintCompiler, tokenizer: Tokenizer, kind: StructuredKind, source: str, text: str
) -> None:
    matcher = compiler.matcher(StructuredSpec(kind, source))
    assert not _allowed(matcher, tokenizer.vocab_size) & STOPS  # nothing generated yet
    _drive(matcher, tokenizer, text)
    assert _allowed(matcher, tokenizer.vocab_size) == set(STOPS)
    assert matcher.is_accepting and matcher.num_tokens == len(tokenizer.encode(text))


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (StructuredSpec(StructuredKind.REGEX, "a(", "guided_regex"), "guided_regex"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, "{not json", "guided_json"), "guided_json"),
        (
            StructuredSpec(
                StructuredKind.JSON_SCHEMA, json.dumps({"type": "frobnicate"}), "response_format"
            ),
            "frobnicate",
        ),
        (StructuredSpec(StructuredKind.GRAMMAR, "start: undefined_rule", "grammar"), "grammar"),
    ],
)
def test_uncompilable_specs_are_refused(
    compiler: ConstraintCompiler, spec: StructuredSpec, needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == spec.param and needle in str(info.value)


def test_refused_token_ends_the_request(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.matcher(StructuredSpec(StructuredKind.REGEX, "[0-9]+"))
    matcher.accept(tokenizer.encode("x")[0], STOPS)
    assert matcher.is_finished and _allowed(matcher, tokenizer.vocab_size) == set(STOPS)


def test_sync_replays_outputs_once(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    spec = StructuredSpec(StructuredKind.CHOICE, json.dumps(["alpha beta", "alpha gamma"]))
    outputs = tokenizer.encode("alpha gamma")
    fresh = compiler.matcher(spec)
    fresh.sync(outputs[:1], STOPS)  # a matcher made after a move catches up
    fresh.sync(outputs[:1], STOPS)  # and never accepts a token twice
    assert fresh.num_tokens == 1
    ahead = compiler.matcher(spec)
    _drive(ahead, tokenizer, "alpha beta")
    ahead.sync(outputs, STOPS)  # saw tokens its request did not keep: replays from the start
    assert ahead.num_tokens == len(outputs) and _allowed(ahead, tokenizer.vocab_size) == set(STOPS)


def test_compiles_are_cached(compiler: ConstraintCompiler) -> None:
    spec = StructuredSpec(StructuredKind.REGEX, "[xyz]{2}")
    compiler.compile(spec)
    size = len(compiler._cache)
    compiler.compile(StructuredSpec(StructuredKind.REGEX, "[xyz]{2}", "guided_regex"))
    assert len(compiler._cache) == size


def _rows(num_rows: int, size: int) -> np.ndarray:
    return np.full((num_rows, -(-size // 32)), -1, dtype=np.int32)


def _bits(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def test_draft_rows_are_the_masks_after_each_draft(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    answer = tokenizer.encode('{"city":"Paris"}')
    size = tokenizer.vocab_size
    for kept in (0, 2):  # drafts from the start, and after outputs already kept
        walked = compiler.matcher(spec)
        walked.sync(answer[:kept], STOPS)
        drafts = [*answer[kept:], 2]  # the answer, then the end token
        rows = _rows(1 + len(drafts), size)
        walked.fill_drafts(rows, drafts, STOPS)
        assert walked.num_tokens == kept  # rolled back: where it began
        assert _bits(rows[0]) == _allowed(walked, size)
        stepped = compiler.matcher(spec)  # the same positions, one accepted token at a time
        stepped.sync(answer[:kept], STOPS)
        for j, token_id in enumerate(drafts):
            assert _bits(rows[j]) == _allowed(stepped, size), j
            if token_id not in STOPS:
                stepped.accept(token_id, STOPS)
        assert _allowed(stepped, size) == set(STOPS)
        assert _bits(rows[-1]) == set(range(size + 31 & ~31))  # past the end token: untouched


def test_a_refused_draft_ends_the_walk(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    spec = StructuredSpec(StructuredKind.REGEX, "[0-9]+")
    digits, letter = tokenizer.encode("12"), tokenizer.encode("x")[0]
    drafts = [*digits, letter, *digits]
    matcher = compiler.matcher(spec)
    rows = _rows(1 + len(drafts), tokenizer.vocab_size)
    matcher.fill_drafts(rows, drafts, STOPS)
    refused = len(digits)  # the row that refuses the letter is written; those after it are not
    assert letter not in _bits(rows[refused]) and digits[0] in _bits(rows[refused])
    assert all(r.min() == r.max() == -1 for r in rows[refused + 1 :])
    assert matcher.num_tokens == 0 and not matcher.is_finished
    assert _allowed(matcher, tokenizer.vocab_size) == _bits(rows[0])
