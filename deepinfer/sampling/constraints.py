"""Grammar constraints on sampling (structured output), on llguidance.

- `ConstraintCompiler`: one per engine. Turns a `StructuredSpec` into a checked grammar and keeps
  it in an LRU cache keyed by the spec's kind and text, bounded in entries and in bytes. The
  engine compiles at submit, off the event loop: a new grammar is built first in the probe's
  child process (`grammar_probe.py`: a crash, the time budget or the library's refusal there is
  a 400, remembered so a repeat costs nothing), then here on a compile thread with a larger
  stack. Its first mask is computed there too (`grammar.build_start`), so no serving step pays
  for building a lexer. The compiled grammar is a matcher in its start state; each request gets
  a deep copy.
- `ConstraintMatcher`: one per request, owned by the model runner beside its random stream.
  `fill` writes the row of allowed tokens into a packed int32 bitmask (bit t of word t // 32);
  `fill_drafts` one row per position of a speculative step (the drafts walked, then rolled
  back); `accept` advances by a kept token, once per token, on the worker thread.

Stop tokens: the grammar knows one end token (`GrammarVocabulary.eos_token_id`); a row's mask
allows every stop token of its request exactly when the grammar allows that end token, and only
them once the grammar is complete. A matcher in error (a token it refused) or with nothing
allowed also allows only the stop tokens: the request ends instead of leaving the grammar.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import llguidance as llg
import numpy as np

from deepinfer.errors import InvalidRequestError
from deepinfer.request import StructuredSpec
from deepinfer.sampling.grammar import (
    ENGINE_STACK_BYTES,
    GrammarError,
    build_start,
    llg_tokenizer,
    run_on_stack,
)
from deepinfer.sampling.grammar_probe import GrammarProbe
from deepinfer.sampling.vocabulary import GrammarVocabulary


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

    def fill_drafts(
        self, rows: np.ndarray, drafts: Sequence[int], stop_token_ids: frozenset[int]
    ) -> None:
        """Write the allowed tokens at each position of a verified run into `rows` (`[1 + D,
        W]`): row j as `fill` would after `drafts[:j]` were accepted, walking the drafts and
        rolling back, so the matcher ends where it began. A draft its row refuses (or a stop
        token) ends the walk: the rows after it are left as they are, since verification keeps
        no token past a draft the model's pick disagrees with (the pick honours the mask)."""
        assert len(rows) == 1 + len(drafts), "a row per position"
        walked = 0
        try:
            for j, row in enumerate(rows):
                self.fill(row, stop_token_ids)
                if j == len(drafts):
                    break
                token_id = drafts[j]
                if token_id in stop_token_ids or not _test_bit(row, token_id):
                    break
                if not self._matcher.consume_token(token_id):
                    break
                walked += 1
        finally:
            if walked:
                self._matcher.rollback(walked)

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


@dataclass(frozen=True)
class CompilerLimits:
    """What the compiler may spend on grammars."""

    max_cached: int = 512
    """Compiled grammars kept (LRU)."""
    max_cached_bytes: int = 512 << 20
    """Bytes the kept grammars may hold together (as the probe measured each)."""
    max_failures: int = 4096
    """Refused grammars remembered (by digest), so a repeat is refused at once."""
    compile_timeout_s: float = 10.0
    """Seconds a new grammar may take to build in the probe."""
    probe: bool = True
    """Build each new grammar in the probe's child process first."""


@dataclass(frozen=True, eq=False)
class _Compiled:
    start: llg.LLMatcher
    num_bytes: int


class ConstraintCompiler:
    """Compiles specs once (LRU by kind and text, bounded in bytes) and makes per-request
    matchers. Thread-safe: submit compiles on executor threads, workers make matchers on theirs.
    The tokenizer for the library and the probe are made on first use, so engines that never
    constrain pay nothing."""

    def __init__(
        self, vocabulary: Callable[[], GrammarVocabulary], limits: CompilerLimits | None = None
    ) -> None:
        self._vocabulary = vocabulary
        self.limits = limits or CompilerLimits()
        self._vocab: GrammarVocabulary | None = None
        self._tokenizer: llg.LLTokenizer | None = None
        self._probe: GrammarProbe | None = None
        self._cache: OrderedDict[bytes, _Compiled] = OrderedDict()
        self._failures: OrderedDict[bytes, str] = OrderedDict()
        self.cached_bytes = 0
        """Bytes the kept grammars hold together."""
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec) -> None:
        """Check and cache `spec`'s grammar; `InvalidRequestError` naming what was refused (the
        spec's `param`, or a part's) when it cannot be compiled. Blocks: call it off the loop."""
        key = _key(spec)
        with self._lock:
            if self._lookup(key, spec) is not None:
                return
        for part in spec.parts:
            self._check_part(part)
        self._start(spec, probe=self.limits.probe)

    def _check_part(self, part: StructuredSpec) -> None:
        """Probe a piece on its own (not kept: its whole grammar is); refusals are remembered."""
        key = _key(part)
        with self._lock:
            if self._lookup(key, part) is not None:
                return
        if self.limits.probe:
            result = self.probe.check(part.kind, part.source)
            if result.error is not None:
                self._refuse(key, part, result.error)

    def matcher(self, spec: StructuredSpec) -> ConstraintMatcher:
        """A new matcher at the start of `spec`'s grammar (compiled again if evicted since its
        request's submit: probed then, so it is known to build)."""
        start = self._start(spec, probe=False)
        vocab = self.vocab
        return ConstraintMatcher(start, vocab.size, vocab.eos_token_id)

    def close(self) -> None:
        """Stop the probe's child (a later compile starts another)."""
        probe = self._probe
        if probe is not None:
            probe.close()

    @property
    def probe(self) -> GrammarProbe:
        with self._lock:
            if self._probe is None:
                self._probe = GrammarProbe(self._vocab_locked(), self.limits.compile_timeout_s)
            return self._probe

    @property
    def vocab(self) -> GrammarVocabulary:
        with self._lock:
            return self._vocab_locked()

    def _vocab_locked(self) -> GrammarVocabulary:
        if self._vocab is None:
            self._vocab = self._vocabulary()
        return self._vocab

    def _start(self, spec: StructuredSpec, probe: bool) -> llg.LLMatcher:
        key = _key(spec)
        with self._lock:
            if (compiled := self._lookup(key, spec)) is not None:
                return compiled.start
        num_bytes = len(spec.source)
        if probe:
            result = self.probe.check(spec.kind, spec.source)
            if result.error is not None:
                self._refuse(key, spec, result.error)
            num_bytes = result.num_bytes
        with self._lock:
            tokenizer = self._llg_tokenizer()
        try:
            start = run_on_stack(
                lambda: build_start(spec.kind, spec.source, tokenizer), ENGINE_STACK_BYTES
            )
        except GrammarError as exc:
            self._refuse(key, spec, str(exc))
        with self._lock:
            self._keep(key, _Compiled(start, num_bytes))
        return start

    def _lookup(self, key: bytes, spec: StructuredSpec) -> _Compiled | None:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        reason = self._failures.get(key)
        if reason is not None:
            self._failures.move_to_end(key)
            raise _refusal(spec, reason)
        return None

    def _refuse(self, key: bytes, spec: StructuredSpec, reason: str) -> None:
        with self._lock:
            self._failures[key] = reason
            self._failures.move_to_end(key)
            while len(self._failures) > self.limits.max_failures:
                self._failures.popitem(last=False)
        raise _refusal(spec, reason)

    def _keep(self, key: bytes, compiled: _Compiled) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self.cached_bytes -= old.num_bytes
        self._cache[key] = compiled
        self.cached_bytes += compiled.num_bytes
        limits = self.limits
        while len(self._cache) > 1 and (
            len(self._cache) > limits.max_cached or self.cached_bytes > limits.max_cached_bytes
        ):
            _, evicted = self._cache.popitem(last=False)
            self.cached_bytes -= evicted.num_bytes

    def _llg_tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self._vocab_locked())
        return self._tokenizer

    def check_integrity(self) -> None:
        with self._lock:
            assert self.cached_bytes == sum(c.num_bytes for c in self._cache.values())
            assert len(self._cache) <= max(self.limits.max_cached, 1)
            assert len(self._failures) <= self.limits.max_failures


def _key(spec: StructuredSpec) -> bytes:
    """The cache key: the kind and a digest of the text (the text itself may be 256 KiB)."""
    digest = hashlib.sha256(spec.source.encode("utf-8", "surrogatepass")).digest()
    return spec.kind.value.encode() + b":" + digest


def _refusal(spec: StructuredSpec, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"{spec.param}: the {spec.kind.value} {reason}", param=spec.param)


def _test_bit(words: np.ndarray, token_id: int) -> bool:
    return bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)


def _set_bit(words: np.ndarray, token_id: int, value: bool) -> None:
    word = int(words[token_id >> 5]) & 0xFFFFFFFF
    bit = 1 << (token_id & 31)
    word = word | bit if value else word & ~bit
    words[token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word
