"""Tokenizer: rebuilt from GGUF metadata, checked against transformers and llama.cpp's split rules."""

from __future__ import annotations

from typing import Any

import pytest
import regex

from deepinfer.errors import ModelLoadError
from deepinfer.text.tokenizer import Tokenizer
from tests.text.text_samples import SAMPLES, random_texts

# llama.cpp's `smollm` pre-tokenizer: `\p{N}` isolated first, then the GPT-2 regex.
GPT2_REGEX = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
WHITESPACE_THEN_DIGIT = regex.compile(r"\s\s\p{N}|\s\s+$|^\s+\p{N}")
CONTROL_TEXT = regex.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<repo_name>|<file_sep>")

ALL_TEXTS = SAMPLES + random_texts(seed=0, count=300)


def llama_cpp_pieces(text: str) -> list[str]:
    pieces = []
    for part in regex.split(r"(\p{N})", text):
        pieces += GPT2_REGEX.findall(part)
    return pieces


@pytest.mark.slow
def test_matches_llama_cpp_split_rules(smollm_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    """Oracle: llama.cpp's smollm split rules, with each piece BPE-encoded by transformers."""
    for text in ALL_TEXTS:
        if CONTROL_TEXT.search(text):
            continue
        expected = [
            i
            for p in llama_cpp_pieces(text)
            for i in hf_gguf_tokenizer.encode(p, add_special_tokens=False).ids
        ]
        assert smollm_tokenizer.encode(text) == expected, repr(text)


@pytest.mark.slow
def test_matches_transformers_gguf_tokenizer(
    smollm_tokenizer: Tokenizer, hf_gguf_tokenizer: Any
) -> None:
    """Equal to transformers' GGUF tokenizer (specials parsed) wherever the two split rules agree.

    transformers drops the smollm digit rule, so it differs only where whitespace runs meet digits
    (`"x  12"`: transformers `Ġ Ġ 1 2`, the model's own tokenizer.json and llama.cpp `ĠĠ 1 2`).
    """
    num_compared = 0
    for text in ALL_TEXTS:
        expected = hf_gguf_tokenizer.encode(text, add_special_tokens=False).ids
        got = smollm_tokenizer.encode_with_specials(text)
        if WHITESPACE_THEN_DIGIT.search(text) and got != expected:
            continue
        assert got == expected, repr(text)
        num_compared += 1
    assert num_compared > len(ALL_TEXTS) // 2
    assert smollm_tokenizer.encode("x  12") == [104, 256, 33, 34]


@pytest.mark.slow
def test_metadata(smollm_tokenizer: Tokenizer, hf_gguf_tokenizer: Any, gguf_reader: Any) -> None:
    tok = smollm_tokenizer
    assert tok.vocab_size == 49152 == hf_gguf_tokenizer.get_vocab_size()
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.added_token_ids == tok.special_token_ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (1, 2, False)
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("no such token") is None
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.chat_template == gguf_reader.fields["tokenizer.chat_template"].contents()


@pytest.mark.slow
def test_content_never_parses_specials(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    for token_id in sorted(tok.special_token_ids):
        text = f"a{tok.id_to_token(token_id)}b"
        ids = tok.encode(text)
        assert not set(ids) & tok.special_token_ids
        assert tok.decode(ids) == text
        assert token_id in tok.encode_with_specials(text)


@pytest.mark.slow
def test_decode_round_trip_and_transformers(
    smollm_tokenizer: Tokenizer, hf_gguf_tokenizer: Any
) -> None:
    for text in ALL_TEXTS:
        ids = smollm_tokenizer.encode(text)
        assert smollm_tokenizer.decode(ids) == text
        assert smollm_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids)
    ids = smollm_tokenizer.encode_with_specials("<|im_start|>user\nhi<|im_end|>")
    assert smollm_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smollm_tokenizer.encode_batch(["a b", "1 2"]) == [
        smollm_tokenizer.encode("a b"),
        smollm_tokenizer.encode("1 2"),
    ]


@pytest.mark.slow
def test_from_dir_round_trip(smollm_tokenizer: Tokenizer, tmp_path: Any) -> None:
    smollm_tokenizer.save_dir(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    for text in ALL_TEXTS[:80]:
        assert loaded.encode(text) == smollm_tokenizer.encode(text)
        assert loaded.encode_with_specials(text) == smollm_tokenizer.encode_with_specials(text)
    assert loaded.special_token_ids == smollm_tokenizer.special_token_ids
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos) == (1, 2, False)
    assert loaded.chat_template == smollm_tokenizer.chat_template


class FakeField:
    def __init__(self, value: Any) -> None:
        self.value = value

    def contents(self) -> Any:
        return self.value


class FakeReader:
    def __init__(self, **fields: Any) -> None:
        self.fields = {f"tokenizer.ggml.{k}": FakeField(v) for k, v in fields.items()}


def tiny_reader(pre: str, model: str = "gpt2") -> FakeReader:
    tokens = ["<|end|>", "a", "b", "Ġ", "ab", "1", "2", "Ġa"]
    return FakeReader(
        model=model,
        pre=pre,
        tokens=tokens,
        merges=["a b", "Ġ a"],
        token_type=[3, 1, 1, 1, 1, 1, 1, 1],
        bos_token_id=0,
        eos_token_id=0,
        add_bos_token=True,
    )


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_tiny_vocab_pre_tokenizers(pre: str) -> None:
    tok = Tokenizer.from_gguf(tiny_reader(pre))
    assert tok.encode("ab a") == [4, 7]
    assert tok.encode("<|end|>") != [0] and tok.encode_with_specials("<|end|>") == [0]
    # `\p{N}{1,3}` (llama-bpe) keeps "12" as one piece; the vocab lacks it either way.
    assert tok.encode("12") == [5, 6]
    assert tok.add_bos and tok.special_token_ids == frozenset({0})


def test_unsupported_gguf_tokenizers_are_named() -> None:
    with pytest.raises(ModelLoadError, match="smollm"):
        Tokenizer.from_gguf(tiny_reader("deepseek-coder"))
    with pytest.raises(ModelLoadError, match="gpt2"):
        Tokenizer.from_gguf(tiny_reader("default", model="llama"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir("/nonexistent")


def test_max_token_bytes_of_a_tiny_vocabulary(tmp_path: Any) -> None:
    """Control tokens are never produced by `encode`: the longest others are "ab" and "Ġa"."""
    tok = Tokenizer.from_gguf(tiny_reader("gpt2"))
    assert tok.max_token_bytes == 2
    tok.save_dir(tmp_path)
    assert Tokenizer.from_dir(tmp_path).max_token_bytes == 2


def test_max_token_bytes_unknown_without_a_byte_level_vocabulary(tmp_path: Any) -> None:
    """A whitespace pre-tokenizer drops text, so no token length bounds a prompt's tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("a " * 100) == [0] * 100
    assert tok.max_token_bytes is None


@pytest.mark.slow
def test_max_token_bytes_bounds_every_encoding(smollm_tokenizer: Tokenizer) -> None:
    """It is the longest token's decoded text, and no text needs fewer tokens than its bytes
    divided by it."""
    tok = smollm_tokenizer
    decoded = [
        len(tok.decode([i]).encode("utf-8"))
        for i in range(tok.vocab_size)
        if i not in tok.special_token_ids
    ]
    assert tok.max_token_bytes == max(decoded) == 81
    assert tok.max_token_bytes is not None
    for text in [*ALL_TEXTS, "\n" + " " * 4000, "#" * 5000, "日本語" * 300]:
        assert len(text.encode("utf-8")) <= tok.max_token_bytes * len(tok.encode(text))


@pytest.mark.slow
def test_long_texts_encode_alike_and_let_other_threads_run(smollm_tokenizer: Tokenizer) -> None:
    """Past 16k characters `encode` goes through `tokenizers`' batch call (which releases the
    GIL): the same ids as the single call, control-token text kept plain, and a thread beside
    it keeps running while it works."""
    import threading
    import time

    text = "<|im_start|>user lighthouse keeper 12345 " * 30_000  # ~1.2 MB
    content = smollm_tokenizer._content
    expected = list(content.encode(text, add_special_tokens=False).ids)
    assert smollm_tokenizer.encode(text) == expected and 1 not in expected
    special = smollm_tokenizer._special
    assert smollm_tokenizer.encode_with_specials(text) == list(
        special.encode(text, add_special_tokens=False).ids
    )
    wakeups = 0
    worker = threading.Thread(target=smollm_tokenizer.encode, args=(text,))
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        wakeups += 1
    assert wakeups >= 20  # the single call holds the GIL: the loop here wakes once or twice
