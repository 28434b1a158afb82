"""The vocabulary as grammar libraries see it: the bytes each token id stands for.

Built once per engine from the serving tokenizer (any object with the `TokenizerLike` methods:
the sampling layer never imports `text/`). Byte-level BPE pieces are spelled in GPT-2's byte
alphabet; control tokens keep their text and are marked special, so no grammar ever emits one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.byte_alphabet import unicode_to_bytes


class TokenizerLike(Protocol):
    vocab_size: int
    special_token_ids: frozenset[int]
    added_token_ids: frozenset[int]
    eos_token_id: int | None

    def id_to_token(self, token_id: int) -> str | None: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class GrammarVocabulary:
    """Token id -> bytes (`b""` for ids with no piece), plus what a grammar library needs."""

    token_bytes: tuple[bytes, ...]
    special_token_ids: frozenset[int]
    eos_token_id: int
    encode: Callable[[str], Sequence[int]]

    @property
    def size(self) -> int:
        return len(self.token_bytes)


def vocabulary_from(tokenizer: TokenizerLike, eos_token_id: int) -> GrammarVocabulary:
    """The byte spelling of every id of a byte-level BPE `tokenizer`; `eos_token_id` is the
    token a finished grammar allows (the request's other stop tokens are added per row)."""
    decoder = unicode_to_bytes()
    pieces: list[bytes] = []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(token_id) or ""
        if token_id in tokenizer.added_token_ids or any(ch not in decoder for ch in piece):
            pieces.append(piece.encode())
        else:
            pieces.append(bytes(decoder[ch] for ch in piece))
    return GrammarVocabulary(
        token_bytes=tuple(pieces),
        special_token_ids=tokenizer.special_token_ids,
        eos_token_id=eos_token_id,
        encode=tokenizer.encode,
    )
