"""Incremental detokenizer: streamed text equals one-shot decoding, never half a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.text.detokenizer import CONTROL_MARK, IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer
from tests.text.text_samples import SAMPLES, random_texts

MULTIBYTE = [
    "🤗🚀👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵",
    "日本語のテキスト、中文字符，한국어 文字化け",
    "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0352\u0353",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 \U0001f9ec",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, k = [], 0
    while k < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        pieces.append(detok.push(ids[k : k + n]))
        detok.check_integrity()
        k += n
    pieces.append(detok.flush())
    return pieces


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_concatenation_equals_decode(smollm_tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(1)
    texts = SAMPLES + MULTIBYTE + random_texts(seed=2, count=200)
    for text in texts:
        ids = smollm_tokenizer.encode_with_specials(text)
        pieces = stream(IncrementalDetokenizer(smollm_tokenizer, skip), ids, rng)
        assert "".join(pieces) == smollm_tokenizer.decode(ids, skip_special_tokens=skip), text
        assert all("\ufffd" not in p for p in pieces), text  # no half characters, ever


@pytest.mark.slow
def test_holds_partial_characters(smollm_tokenizer: Tokenizer) -> None:
    ids = smollm_tokenizer.encode("🤗")
    assert len(ids) > 1  # byte-level BPE cuts this emoji
    detok = IncrementalDetokenizer(smollm_tokenizer)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🤗"
    detok.push(ids[:1])
    assert detok.flush() == "\ufffd"  # an unfinished character becomes U+FFFD at the end


@pytest.mark.slow
def test_random_ids_match_decode(smollm_tokenizer: Tokenizer) -> None:
    """Arbitrary ids (invalid UTF-8 included) still concatenate to the one-shot decode."""
    rng = random.Random(3)
    for _ in range(100):
        ids = [rng.randrange(smollm_tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        pieces = stream(IncrementalDetokenizer(smollm_tokenizer), ids, rng)
        assert "".join(pieces) == smollm_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_window_stays_small(smollm_tokenizer: Tokenizer) -> None:
    ids = smollm_tokenizer.encode(" ".join(SAMPLES) * 4)
    detok = IncrementalDetokenizer(smollm_tokenizer)
    for i in ids:
        detok.push([i])
        assert detok.num_window_tokens <= 8  # O(new tokens): the window never grows with the stream
    assert detok.num_tokens == len(ids)


@pytest.mark.slow
def test_byte_level_vocabulary_decodes_without_the_tokenizer(smollm_tokenizer: Tokenizer) -> None:
    """SmolLM2's byte-level vocabulary: every id's bytes are known, so streams join bytes."""
    pieces = smollm_tokenizer.byte_pieces
    assert pieces is not None and len(pieces) == smollm_tokenizer.vocab_size
    assert all(pieces[i] == b"" for i in smollm_tokenizer.special_token_ids)
    hello = smollm_tokenizer.encode(" Hello, wörld")
    assert b"".join(pieces[i] for i in hello) == " Hello, wörld".encode()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streams_of_any_ids_match_decode(smollm_tokenizer: Tokenizer, data: st.DataObject) -> None:
    """Any ids (control tokens, bytes that are no UTF-8, cut characters, ids past the
    vocabulary), pushed in any runs, concatenate to the one-shot decode, with and without control
    tokens skipped."""
    vocab = smollm_tokenizer.vocab_size
    special = sorted(smollm_tokenizer.special_token_ids)
    padded = st.integers(vocab, vocab + 100)  # a model's rows past the vocabulary
    token = st.one_of(
        st.integers(0, vocab - 1), st.sampled_from(special), st.integers(0, 511), padded
    )
    ids = data.draw(st.lists(token, min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    runs = data.draw(st.lists(st.integers(1, 5), min_size=len(ids), max_size=len(ids)))
    detok, k, out = IncrementalDetokenizer(smollm_tokenizer, skip), 0, []
    for n in runs:
        if k >= len(ids):
            break
        out.append(detok.push(ids[k : k + n]))
        k += n
    out.append(detok.flush())
    assert "".join(out) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize("byte_level", [True, False])
def test_shown_control_tokens_are_the_mark(smollm_tokenizer: Tokenizer, byte_level: bool) -> None:
    """A shown control token is CONTROL_MARK in place, wherever the pushes cut the ids; its text
    typed as content stays text. `byte_level=False` runs the window path (SentencePiece's)."""
    tok = smollm_tokenizer
    shown = tok.token_to_id("<|im_start|>")
    assert shown is not None and shown in tok.special_token_ids
    before, after = "Sure, 日本 <|im_start|> typed 🤗", ' [{"name": "f"}] 🤗'
    ids = [*tok.encode(before), shown, *tok.encode(after), shown]
    rng = random.Random(3)
    for _ in range(30):
        detok = IncrementalDetokenizer(tok, shown_ids=frozenset({shown}))
        if not byte_level:
            detok._pieces = None
        text = "".join(stream(detok, ids, rng))
        assert text == f"{before}{CONTROL_MARK}{after}{CONTROL_MARK}"
        assert detok.num_tokens == len(ids)
    plain = "".join(stream(IncrementalDetokenizer(tok), ids, rng))
    assert plain == before + after and CONTROL_MARK not in plain
