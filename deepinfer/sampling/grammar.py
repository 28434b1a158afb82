"""One grammar built with llguidance, the same way wherever it is built: the engine's compiler
(`constraints.py`) and the probe's child process (`grammar_probe.py`) both call `build_start`.

A grammar is built on a thread of its own with a stack of known size (`run_on_stack`): the
library's compiler recurses with the grammar's nesting, so the stack is what bounds how deep a
grammar can go. The probe's child builds with `PROBE_STACK_BYTES`, the engine with
`ENGINE_STACK_BYTES`, twice as much: a grammar that the child built, the engine builds too.

`build_start` also computes the grammar's first mask from a fresh copy: the library builds its
lexer lazily, and the first mask of a large regex can take a second and hundreds of MB. Done
here, that work happens where grammars are compiled (the probe, a compile thread), never in a
serving step, and a grammar whose lexer the library gives up on is refused before it is used.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import llguidance as llg
import numpy as np

from deepinfer.request import StructuredKind
from deepinfer.sampling.vocabulary import GrammarVocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

T = TypeVar("T")

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""Compact JSON (`{"a":1}`): the shortest output, and no unbounded runs of whitespace."""

PROBE_STACK_BYTES = 16 << 20
"""Stack of the probe's compile thread (reserved address space; pages are touched as used)."""
ENGINE_STACK_BYTES = 2 * PROBE_STACK_BYTES
"""Stack of the engine's compile threads: more than the probe's, so a probed grammar builds."""
COMPILE_NICENESS = 5
"""Compiles run at this niceness (per thread on Linux): a new grammar's seconds of compiling
yield to the decode and prefill workers' steps when the cores are contended."""
MAX_ERROR_CHARS = 600
"""The library's messages can quote the whole grammar: errors returned are cut to this."""


class GrammarError(ValueError):
    """The grammar library refused a grammar (the message says why)."""


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


def grammar_text(kind: StructuredKind, source: str) -> str:
    """The llguidance grammar of a spec; raises ValueError for text that is no grammar."""
    if kind is StructuredKind.JSON_SCHEMA:
        return llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if kind is StructuredKind.JSON_OBJECT:
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind is StructuredKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(source)
    if kind is StructuredKind.CHOICE:
        return llg.grammar_from("choice", source)
    return llg.LLMatcher.grammar_from_lark(source)


def build_start(
    kind: StructuredKind, source: str, tokenizer: llg.LLTokenizer, num_warm_masks: int = 1
) -> llg.LLMatcher:
    """The matcher at the start of the grammar, its lexer built by `num_warm_masks` first masks
    (each from a fresh copy); `GrammarError` when the library refuses it at any point."""
    try:
        grammar = grammar_text(kind, source)
    except ValueError as exc:
        raise GrammarError(_cut(str(exc))) from None
    start = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
    if start.is_error():
        raise GrammarError(f"cannot be compiled: {_cut(start.get_error())}")
    row = np.zeros(_mask_words(tokenizer), dtype=np.int32)
    for _ in range(num_warm_masks):
        copy = start.deep_copy()
        copy.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if copy.is_error():
            raise GrammarError(f"is too complex for the grammar library: {_cut(copy.get_error())}")
    return start


def _limits() -> llg.LLParserLimits:
    """The library's own limits, with errors that do not quote the parser's state."""
    return llg.LLParserLimits(verbose_errors=False)


def _mask_words(tokenizer: llg.LLTokenizer) -> int:
    return -(-tokenizer.vocab_size // 32)


def _cut(message: str) -> str:
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


def run_on_stack(fn: Callable[[], T], stack_bytes: int) -> T:
    """`fn()` on a new thread with `stack_bytes` of stack, at `COMPILE_NICENESS`; returns its
    result or raises its exception. Blocks the calling thread (call it off the event loop)."""
    box: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        _lower_priority()
        try:
            box.append(fn())
        except BaseException as exc:
            failure.append(exc)

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=body, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if failure:
        raise failure[0]
    return box[0]


_STACK_SIZE_LOCK = threading.Lock()
"""`threading.stack_size` is process-wide: held while one thread is started with another size."""


def _lower_priority() -> None:
    # not Linux, or not permitted: compile at the process's own priority
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
