"""GPT-2's byte alphabet: each of the 256 byte values spelled as one printable character, as
byte-level BPE vocabularies store their tokens. A leaf: the tokenizer (`text/`) and the
grammar vocabulary (`sampling/`) both read tokens spelled this way."""

from __future__ import annotations

import functools


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """byte -> the printable character that spells it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """The printable character -> the byte it spells."""
    return {c: b for b, c in bytes_to_unicode().items()}
