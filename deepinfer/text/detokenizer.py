"""Incremental detokenization: token ids in, only new complete text out.

Byte-level BPE tokens can cut a multi-byte character in two, and some decoders change a token's
text depending on what precedes it (SentencePiece's leading space). So each push decodes a small
window twice, once up to the last emitted token (`prefix`) and once to the end, and emits the
difference, and only when the window does not end in a partial character (U+FFFD). The window is
the tokens since the previous emission plus the batch before them, so a push costs O(new tokens),
not O(all tokens). This is the prefix-offset/read-offset technique of vLLM and TGI.

A byte-level vocabulary (`Tokenizer.byte_pieces`) decodes by joining each id's bytes, so there
the detokenizer joins them itself and emits every complete character: an incremental UTF-8
decoder holds back a cut character, and the tokenizer is never called.

Shown control tokens (`shown_ids`, a tool-call parser's markers such as Mistral's `[TOOL_CALLS]`)
are written as `CONTROL_MARK` instead of being dropped: a lone surrogate, which no decoded text
holds (UTF-8 decoding never yields one), so text the model spelled can never pass for the marker.
Whoever asks for shown ids consumes the mark before the text leaves the process.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from deepinfer.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTROL_MARK = "\ud800"
"""Written for each shown control token (see the module docstring)."""


class IncrementalDetokenizer:
    """Turns a growing stream of ids into text; the concatenation of every `push` and the final
    `flush` equals `tokenizer.decode(all_ids, skip_special_tokens)`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        shown_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        self._shown = shown_ids
        """Control tokens written as `CONTROL_MARK` (with `skip_special_tokens`)."""
        self._skip_special_tokens = skip_special_tokens
        self._pieces = tokenizer.byte_pieces if skip_special_tokens else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []
        """Ids from `_prefix_offset` on; older ids are dropped (they never enter a window again)."""
        self._prefix_offset = 0
        """Start of the decode window, relative to `_ids` (always 0 after trimming)."""
        self._read_offset = 0
        """End of what has been emitted, relative to `_ids`."""
        self.num_tokens = 0
        """Ids pushed so far."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; return the text they complete (possibly empty)."""
        self.num_tokens += len(token_ids)
        if self._shown and not self._shown.isdisjoint(token_ids):
            return self._push_shown(token_ids)
        if self._pieces is not None:
            pieces = self._pieces
            try:
                data = b"".join([pieces[i] for i in token_ids])
            except IndexError:  # an id past the vocabulary (a model's padded rows) reads as nothing
                data = b"".join([pieces[i] if 0 <= i < len(pieces) else b"" for i in token_ids])
            return self._utf8.decode(data)
        self._ids.extend(token_ids)
        if not token_ids:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # a character is still incomplete, or nothing visible yet
        # Keep the batch just emitted as left context for the next window; drop the rest.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _push_shown(self, token_ids: Sequence[int]) -> str:
        """`push` of ids holding shown control tokens: the text before each (held-back text
        flushed, so that it stays before the mark), the mark, then the text after it."""
        self.num_tokens -= len(token_ids)  # each piece below counts its own
        out: list[str] = []
        start = 0
        for k, token_id in enumerate(token_ids):
            if token_id in self._shown:
                out += [self.push(token_ids[start:k]), self.flush(), CONTROL_MARK]
                self.num_tokens += 1
                start = k + 1
        out.append(self.push(token_ids[start:]))
        return "".join(out)

    def flush(self) -> str:
        """The text held back (incomplete characters become U+FFFD); the stream then restarts
        empty."""
        if self._pieces is not None:
            return self._utf8.decode(b"", final=True)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._ids.clear()
        self._read_offset = 0
        return full[len(prefix) :]

    @property
    def num_window_tokens(self) -> int:
        """Ids still kept for decoding (held back plus the last emitted batch)."""
        return len(self._ids)

    def check_integrity(self) -> None:
        """The window never outgrows the held-back tokens plus one emitted batch."""
        assert self._prefix_offset == 0
        assert 0 <= self._read_offset <= len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
