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
