"""The tokenizer: HF `tokenizers` rebuilt from GGUF metadata or loaded from a model directory.

Two `tokenizers.Tokenizer` instances back every `Tokenizer`:

- `content` has `encode_special_tokens = True`: text that spells a control token (`<|im_start|>`)
  encodes as ordinary pieces. Every piece of untrusted text goes through it (`encode`).
- `special` parses control tokens; it is used for decoding and by tests that render a chat template.

The flag is per instance, so the two are never shared or flipped at run time. All heavy work
(vocabulary, merges) happens once, at build time.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.byte_alphabet import bytes_to_unicode, unicode_to_bytes
from deepinfer.errors import ModelLoadError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE = "\u2581"
"""SentencePiece's spelling of a space."""

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm", *_SPLIT_REGEXES)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split rules of llama.cpp's `tokenizer.ggml.pre` values, as `tokenizers` pre-tokenizers."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":  # llama.cpp: `\p{N}` first, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_REGEXES:
        split = pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    raise ModelLoadError(
        f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
        f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def _field(reader: Any, key: str) -> Any:
    """A GGUF metadata value (str, bool, int, or list of those); None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


_GIL_FREE_ENCODE_CHARS = 16 << 10
"""Texts this long are encoded through `tokenizers`' batch call, which releases the GIL while it
works: its single-text `encode` holds it throughout (1.3 s for 3 MB of text, during which the
event loop and the workers' steps cannot run). Shorter ones take the cheaper single call. The
fast variant, without character offsets: the ids of 3 MB come back in half the time, and the
GIL is held while they become a list."""
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
"""Off by default (unless the environment sets it): `tokenizers` would hand a batch to its own
thread pool at normal priority, beside the engine's steps, and its threads spin between batches;
a long text is encoded on the calling thread instead, which is the low-priority long-text
thread (`text/long_texts.py`). Read by `tokenizers` at each call."""


class Tokenizer:
    """Text <-> token ids. `encode` never produces a control token from text; build with
    `from_gguf` or `from_dir`."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        os.environ.setdefault(PARALLELISM_ENV, "false")
        self._special = hf  # owned from here on: the constructors build it for this instance
        self._content = HFTokenizer.from_str(hf.to_str())
        self._content.encode_special_tokens = True
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        added = self._special.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        """Control tokens: never produced by `encode`, dropped by `decode(skip_special_tokens=True)`."""
        self.added_token_ids: frozenset[int] = frozenset(added)
        """Every added token, special or not (user-defined ones like `<think>` match in text)."""
        self.vocab_size: int = self._special.get_vocab_size(with_added_tokens=True)
        self.max_token_bytes: int | None = _max_token_bytes(self._special)
        """Most bytes of text one token of `encode` can stand for; None when the vocabulary does
        not bound it (a normalizer may shrink text, a pre-tokenizer may drop it). A text of B
        UTF-8 bytes has at least B / max_token_bytes tokens."""

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """Rebuild from an open `gguf.GGUFReader`: a byte-level BPE `gpt2` vocabulary, or a
        Gemma model's SentencePiece one (`llama`: tokens and scores, no merges).

        Matches transformers' GGUF conversion, except for `pre=smollm`, where the file's own rule
        (digits split one by one, as llama.cpp and the model's `tokenizer.json` do) is applied.
        """
        model = _field(reader, "tokenizer.ggml.model")
        architecture = str(_field(reader, "general.architecture") or "")
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _field(reader, "tokenizer.ggml.token_type") or []
        if not tokens:
            raise ModelLoadError("GGUF file lacks tokenizer.ggml.tokens")
        if model == "gpt2":
            merges: list[str] | None = _field(reader, "tokenizer.ggml.merges")
            if not merges:
                raise ModelLoadError("GGUF file lacks tokenizer.ggml.merges")
            pre = _field(reader, "tokenizer.ggml.pre") or "default"
            hf = _byte_level_bpe(tokens, merges, types, pre)
        elif model == "llama" and architecture.startswith("gemma"):
            unknown = _field(reader, "tokenizer.ggml.unknown_token_id")
            hf = _gemma_sentencepiece(tokens, types, None if unknown is None else int(unknown))
        else:
            raise ModelLoadError(
                f"unsupported GGUF tokenizer tokenizer.ggml.model={model!r} for {architecture!r}; "
                "supported: 'gpt2' (byte-level BPE), and 'llama' (SentencePiece) for Gemma models"
            )
        add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
        return cls(
            hf,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
            add_bos=bool(add_bos) if add_bos is not None else False,
            chat_template=_field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face directory: `tokenizer.json`, plus `tokenizer_config.json` (and
        `chat_template.jinja` when present) for the chat template, BOS/EOS and `add_bos_token`."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ModelLoadError(f"{root} has no tokenizer.json")
        hf = HFTokenizer.from_file(str(root / "tokenizer.json"))
        config_path = root / "tokenizer_config.json"
        config: dict[str, Any] = (
            json.loads(config_path.read_text()) if config_path.is_file() else {}
        )
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()
        bos_id = _named_token_id(hf, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no flag: does the post-processor put BOS first?
            ids = hf.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and ids[:1] == [bos_id]
        return cls(
            hf,
            bos_token_id=bos_id,
            eos_token_id=_named_token_id(hf, config.get("eos_token")),
            add_bos=bool(add_bos),
            chat_template=template,
        )

    def save_dir(self, path: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` that `from_dir` reads back."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self._special.save(str(root / "tokenizer.json"))
        config = {
            "bos_token": None if self.bos_token_id is None else self.id_to_token(self.bos_token_id),
            "eos_token": None if self.eos_token_id is None else self.id_to_token(self.eos_token_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as content: control tokens spelled in it stay plain text; no BOS/EOS."""
        return _encode(self._content, text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` on each text (one by one, each long one without the GIL)."""
        return [self.encode(text) for text in texts]

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids of trusted text, parsing control tokens. Never use this on user input."""
        return _encode(self._special, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        return str(self._special.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def byte_pieces(self) -> tuple[bytes, ...] | None:
        """The bytes each id stands for in `decode(..., skip_special_tokens=True)` (control
        tokens: none), when decoding is byte concatenation: `decode(ids)` is then the UTF-8 of
        the ids' pieces joined, and a detokenizer can skip the tokenizer altogether. None for
        other decoders (SentencePiece), or when any single id decodes otherwise (checked for
        every id, once: about a tenth of a second)."""
        hf = self._special
        if not isinstance(hf.decoder, decoders.ByteLevel):
            return None
        spelling = unicode_to_bytes()
        pieces: list[bytes] = []
        for token_id in range(self.vocab_size):
            token = hf.id_to_token(token_id) or ""
            if token_id in self.special_token_ids:
                pieces.append(b"")
            elif token_id in self.added_token_ids or not set(token) <= spelling.keys():
                pieces.append(token.encode("utf-8"))
            else:
                pieces.append(bytes(spelling[c] for c in token))
        singles = hf.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)
        for piece, text in zip(pieces, singles, strict=True):
            if piece.decode("utf-8", "replace") != text:
                return None
        return tuple(pieces)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token as the vocabulary spells it (byte-level: `Ġ` for a space)."""
        token_id = self._special.token_to_id(token)
        return None if token_id is None else int(token_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of `token_id`; None when out of range."""
        token = self._special.id_to_token(token_id)
        return None if token is None else str(token)


def _encode(hf: HFTokenizer, text: str) -> list[int]:
    if len(text) < _GIL_FREE_ENCODE_CHARS:
        return list(hf.encode(text, add_special_tokens=False).ids)
    ids: list[int] = hf.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return ids


def _max_token_bytes(hf: HFTokenizer) -> int | None:
    """The longest token `encode` can produce, in bytes of text, for byte-level vocabularies
    without a normalizer. A vocabulary token is spelled one character per byte; an added token
    matches its own text (control tokens are never produced by `encode`)."""
    if hf.normalizer is not None or not isinstance(hf.decoder, decoders.ByteLevel):
        return None
    alphabet = frozenset(bytes_to_unicode().values())
    added = hf.get_added_tokens_decoder()
    control = {i for i, t in added.items() if t.special}
    spelled = (
        len(t) if t.isascii() or alphabet.issuperset(t) else len(t.encode("utf-8"))
        for t, i in hf.get_vocab(with_added_tokens=False).items()
        if i not in control
    )
    matched = (len(t.content.encode("utf-8")) for i, t in added.items() if i not in control)
    return max([*spelled, *matched], default=1)


def _named_token_id(hf: HFTokenizer, token: Any) -> int | None:
    """Id of a token given as in tokenizer_config.json: a string or `{"content": ...}`."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    token_id = hf.token_to_id(token)
    return None if token_id is None else int(token_id)


def _gemma_sentencepiece(tokens: list[str], types: list[int], unknown: int | None) -> HFTokenizer:
    """The SentencePiece BPE a Gemma GGUF describes, as `tokenizers` runs it (transformers'
    conversion rules): spaces spelled `\u2581` (no space prepended), unknown bytes spelled by the
    `<0xNN>` tokens, and merges rebuilt from the vocabulary (`_merges_in_file_order`). A token of
    two or more spaces is stored with real spaces and looked up spelled: it is respelled."""
    spelled = [SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if len(vocab) != len(spelled):
        raise ModelLoadError("GGUF vocabulary has duplicate tokens once spaces are respelled")
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_in_file_order(spelled, vocab),
        unk_token=None if unknown is None else spelled[unknown],
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = HFTokenizer(bpe)
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_typed_tokens(hf, list(zip(spelled, types, strict=False)), vocab)
    return hf


def _merges_in_file_order(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every way of cutting a token into two tokens of the vocabulary, as BPE merges ranked by
    the merged token's place in the file (a Gemma file gives no merges, and its scores do not
    follow the merge order: the file's order does), a token's cuts with the longer left piece
    first."""
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _add_typed_tokens(
    hf: HFTokenizer,
    typed: list[tuple[str, int]],
    vocab: dict[str, int],
    alphabet: set[str] | None = None,
) -> None:
    """Control tokens added as special (never produced from text; with `alphabet`, only those
    spelled in it: one outside is a llama.cpp mislabel, which transformers skips too), and
    user-defined ones as plain added tokens (matched whole in text, like `<think>`)."""
    control = [
        t for t, k in typed if k == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in typed if k == TOKEN_TYPE_USER_DEFINED and t in vocab]
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _byte_level_bpe(
    tokens: list[str], merges: list[str], types: list[int], pre: str
) -> HFTokenizer:
    """The BPE tokenizer a GGUF `gpt2` vocabulary describes (transformers' conversion rules)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet is raw text: respell it byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF vocabulary has duplicate tokens after byte-level respelling")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)  # type: ignore[arg-type]
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = _pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    _add_typed_tokens(hf, list(zip(tokens, types, strict=False)), vocab, alphabet)
    return hf
