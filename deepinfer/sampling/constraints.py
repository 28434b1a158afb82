"""Grammar constraints on sampling (structured output), on llguidance.

- `ConstraintCompiler`: one per engine. Turns a `StructuredSpec` into a checked grammar and keeps
  it in an LRU cache keyed by the spec's kind and text; the engine compiles at submit (off the
  event loop), so a grammar the library refuses is a 400 before any work. The compiled grammar
  is a matcher in its start state; each request gets a deep copy.
- `ConstraintMatcher`: one per request, owned by the model runner beside its random stream.
  `fill` writes the row of allowed tokens into a packed int32 bitmask (bit t of word t // 32);
  `accept` advances by a sampled token, once per token, on the worker thread.

Stop tokens: the grammar knows one end token (`GrammarVocabulary.eos_token_id`); a row's mask
allows every stop token of its request exactly when the grammar allows that end token, and only
them once the grammar is complete. A matcher in error (a token it refused) or with nothing
allowed also allows only the stop tokens: the request ends instead of leaving the grammar.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from deepinfer.errors import InvalidRequestError
from deepinfer.request import StructuredKind, StructuredSpec
from deepinfer.sampling.vocabulary import GrammarVocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""Compact JSON (`{"a":1}`): the shortest output, and no unbounded runs of whitespace."""


class _Vocab:
    """`llguidance.TokenizerWrapper`'s view of a `GrammarVocabulary`."""

    def __init__(self, vocab: GrammarVocabulary) -> None:
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        self.tokens = list(vocab.token_bytes)
        self.special_token_ids = sorted(vocab.special_token_ids)
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


def llg_tokenizer(vocab: GrammarVocabulary) -> llg.LLTokenizer:
    """llguidance's tokenizer for `vocab` (~0.2 s for 49k tokens: build it once)."""
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(vocab)))


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of `spec`; raises ValueError for text that is no grammar."""
    if spec.kind is StructuredKind.JSON_SCHEMA:
        return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind is StructuredKind.JSON_OBJECT:
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind is StructuredKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind is StructuredKind.CHOICE:
        return llg.grammar_from("choice", spec.source)
    return llg.LLMatcher.grammar_from_lark(spec.source)


class ConstraintMatcher:
    """One request's position in its grammar. Not thread-safe: one worker thread uses it."""

    def __init__(self, start: llg.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self._start = start
        self._matcher = start.deep_copy()
        self._num_words = -(-vocab_size // 32)
        self._eos = eos_token_id
        self.num_tokens = 0
        """Output tokens seen (accepted, or stop tokens passed over)."""

    def fill(self, row: np.ndarray, stop_token_ids: Iterable[int]) -> None:
        """Write the allowed next tokens into `row`: a C-contiguous int32 array of at least the
        grammar vocabulary's words (bits past it stay 0)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"], "a packed int32 row"
        assert row.size >= self._num_words, "the row is narrower than the vocabulary"
        row[:] = 0
        allow_stops = True
        m = self._matcher
        if not (m.is_error() or m.is_stopped()):
            words = row[: self._num_words]
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            allow_stops = _test_bit(row, self._eos)
            _set_bit(row, self._eos, False)
            allow_stops = allow_stops or not row.any()
        if allow_stops:
            for token_id in stop_token_ids:
                if 0 <= token_id < row.size * 32:
                    _set_bit(row, token_id, True)

    def accept(self, token_id: int, stop_token_ids: frozenset[int]) -> None:
        """Advance by one sampled token (a stop token ends the request: it is passed over)."""
        self.num_tokens += 1
        if token_id not in stop_token_ids:
            self._matcher.consume_token(token_id)  # a refused token leaves it in error

    def sync(self, output_token_ids: Sequence[int], stop_token_ids: frozenset[int]) -> None:
        """Catch up with a request's outputs (a matcher made on another runner after a
        preemption, or one that saw a token its request never kept): replays, never repeats."""
        if self.num_tokens > len(output_token_ids):
            self._matcher = self._start.deep_copy()
            self.num_tokens = 0
        for token_id in output_token_ids[self.num_tokens :]:
            self.accept(token_id, stop_token_ids)

    @property
    def is_finished(self) -> bool:
        """The grammar allows nothing but the end (or the matcher refused a token)."""
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


class ConstraintCompiler:
    """Compiles specs once (LRU by kind and text) and makes per-request matchers. Thread-safe:
    submit compiles on executor threads, workers make matchers on theirs. The tokenizer for the
    library is built on first use, so engines that never constrain pay nothing."""

    def __init__(self, vocabulary: Callable[[], GrammarVocabulary], max_cached: int = 512) -> None:
        self._vocabulary = vocabulary
        self.max_cached = max_cached
        self._vocab: GrammarVocabulary | None = None
        self._tokenizer: llg.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec) -> None:
        """Check and cache `spec`'s grammar; `InvalidRequestError` naming what the library
        refused (the spec's `param`) when it cannot be compiled."""
        self._start(spec)

    def matcher(self, spec: StructuredSpec) -> ConstraintMatcher:
        """A new matcher at the start of `spec`'s grammar (compiled now if evicted meanwhile)."""
        start = self._start(spec)
        vocab = self.vocab
        return ConstraintMatcher(start, vocab.size, vocab.eos_token_id)

    @property
    def vocab(self) -> GrammarVocabulary:
        with self._lock:
            return self._vocab_locked()

    def _vocab_locked(self) -> GrammarVocabulary:
        if self._vocab is None:
            self._vocab = self._vocabulary()
        return self._vocab

    def _start(self, spec: StructuredSpec) -> llg.LLMatcher:
        key = (spec.kind.value, spec.source)
        with self._lock:
            start = self._cache.get(key)
            if start is not None:
                self._cache.move_to_end(key)
                return start
            tokenizer = self._llg_tokenizer()
        start = _compile(spec, tokenizer)
        with self._lock:
            self._cache[key] = start
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return start

    def _llg_tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self._vocab_locked())
        return self._tokenizer


def _compile(spec: StructuredSpec, tokenizer: llg.LLTokenizer) -> llg.LLMatcher:
    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        raise InvalidRequestError(f"{spec.param}: {exc}", param=spec.param) from None
    start = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if start.is_error():
        reason = start.get_error()
        raise InvalidRequestError(
            f"{spec.param}: the {spec.kind.value} cannot be compiled: {reason}", param=spec.param
        )
    return start


def _test_bit(words: np.ndarray, token_id: int) -> bool:
    return bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)


def _set_bit(words: np.ndarray, token_id: int, value: bool) -> None:
    word = int(words[token_id >> 5]) & 0xFFFFFFFF
    bit = 1 << (token_id & 31)
    word = word | bit if value else word & ~bit
    words[token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word
