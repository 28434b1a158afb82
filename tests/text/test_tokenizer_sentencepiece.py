"""SentencePiece vocabularies from GGUF (Gemma): against transformers' GGUF conversion of the
same metadata, on a tiny vocabulary always and on Gemma 3 270M's when it is pulled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer.environment import default_model_dir
from deepinfer.errors import ModelLoadError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.text.tokenizer import Tokenizer
from tests.text.test_tokenizer import FakeField, FakeReader
from tests.text.text_samples import SAMPLES, random_texts

GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
TEXTS = [
    *SAMPLES,
    *random_texts(seed=1, count=200),
    "  two  spaces   three",
    "\t tab\n\n\nnewlines",
    "héllo wörld 你好 🙂",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    " leading and trailing ",
    "a" * 300,
]


class Reader(FakeReader):
    def __init__(self, architecture: str, **tokenizer: Any) -> None:
        super().__init__(**tokenizer)
        self.fields["general.architecture"] = FakeField(architecture)


def tiny_gemma(architecture: str = "gemma3") -> Reader:
    """Specials, the 256 byte tokens, a few pieces whose file order is their merge order, a
    token of two spaces stored with real spaces, and a user-defined newline pair."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581", "t", "h", "e", "o", "w", "he", "\u2581t", "\u2581the", "wo", "  ", "\n\n"]
    tokens += pieces
    types += [1] * (len(pieces) - 1) + [4]
    return Reader(
        architecture,
        model="llama",
        tokens=tokens,
        scores=[-float(i) for i in range(len(tokens))],
        token_type=types,
        bos_token_id=2,
        eos_token_id=1,
        unknown_token_id=3,
        add_bos_token=True,
    )


def reference(reader: Any) -> Any:
    """transformers' tokenizer for the same metadata (`AutoTokenizer.from_pretrained(...,
    gguf_file=...)` builds it this way)."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    def field(key: str) -> Any:
        return reader.fields[f"tokenizer.ggml.{key}"].contents()

    metadata = {
        "tokenizer_type": "llama",
        "tokens": field("tokens"),
        "scores": field("scores"),
        "token_type": field("token_type"),
    }
    backend, _ = convert_gguf_tokenizer(reader.fields["general.architecture"].contents(), metadata)
    return backend


def check_against_reference(tok: Tokenizer, ref: Any, texts: list[str]) -> None:
    for text in texts:
        ids = tok.encode_with_specials(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        content = tok.encode(text)
        assert not set(content) & tok.special_token_ids, text
        assert tok.decode(content) == text, text


def test_tiny_sentencepiece_vocabulary() -> None:
    reader = tiny_gemma()
    tok = Tokenizer.from_gguf(reader)
    check_against_reference(tok, reference(reader), TEXTS)
    assert tok.encode("the") == [tok.token_to_id("t"), tok.token_to_id("he")]
    assert tok.encode(" the") == [tok.token_to_id("\u2581the")]
    assert tok.encode("  ") == [tok.token_to_id("\u2581\u2581")]
    assert tok.encode("é") == [6 + 0xC3, 6 + 0xA9]  # byte fallback
    assert tok.encode_with_specials("<start_of_turn>") == [4]
    assert tok.special_token_ids == frozenset({0, 1, 2, 4, 5})
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (2, 1, True)
    assert tok.byte_pieces is None  # SentencePiece decoding is no byte join: streams decode


def test_sentencepiece_outside_gemma_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="Gemma"):
        Tokenizer.from_gguf(tiny_gemma("llama"))


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3.is_file(), reason="run `deepinfer pull gemma3-270m`")
def test_gemma3_vocabulary() -> None:
    reader = open_gguf(Path(GEMMA3))
    tok = Tokenizer.from_gguf(reader)
    check_against_reference(tok, reference(reader), TEXTS)
    assert tok.vocab_size == 262_144
    assert tok.encode_with_specials("<start_of_turn>user") == [105, 2364]
    assert (tok.bos_token_id, tok.add_bos) == (2, True)
