"""Splitting an answer into reasoning and content: by the marker ids the model sampled, the same
however the answer is cut into deltas, and never by text that only spells a marker.

Answers are ids of the Qwen3 test vocabulary (`test_recipe_reasoning.py`), streamed through the
engine's own incremental detokenizer, so each delta's text lags its ids as the engine's does.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.reasoning import (
    AnswerDelta,
    ReasoningDelta,
    ReasoningFormat,
    ReasoningSplitter,
    spelled_markers,
    split_answer,
    split_think,
)
from deepinfer.text.recipe_reasoning import encode_client_text, reasoning_format
from deepinfer.text.tokenizer import Tokenizer
from tests.text.test_recipe_reasoning import qwen3

__all__ = ["qwen3"]


def answer(tok: Tokenizer, *parts: str | int) -> list[int]:
    """Ids of an answer: texts as plain tokens (a spelled marker stays text), ints as they are."""
    return [i for p in parts for i in (encode_client_text(tok, p) if isinstance(p, str) else [p])]


def streamed(
    tok: Tokenizer, fmt: ReasoningFormat, ids: list[int], rng: random.Random, *, opens: bool
) -> tuple[str, str, bool]:
    """(reasoning, content, opened) from `ids` cut at random, text from the engine's detokenizer
    (sometimes held back a delta, as a stop-string matcher does)."""
    detok = IncrementalDetokenizer(tok)
    splitter = ReasoningSplitter(fmt, lambda i: tok.decode(i, skip_special_tokens=True), opens)
    events = []
    held = ""
    k = 0
    while k < len(ids):
        n = rng.randint(1, 4)
        chunk = ids[k : k + n]
        k += n
        text = held + detok.push(chunk) + (detok.flush() if k >= len(ids) else "")
        held = ""
        if k < len(ids) and rng.random() < 0.3:
            held, text = text, ""
        events += splitter.feed(text, chunk)
    if held:
        events += splitter.feed(held, [])
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, AnswerDelta))
    return reasoning, content, splitter.has_block


@pytest.fixture(scope="module")
def fmt(qwen3: Tokenizer) -> ReasoningFormat:
    return reasoning_format(qwen3, "Qwen3", prompt_opens=False)


@pytest.mark.slow
def test_split_by_marker_ids(qwen3: Tokenizer, fmt: ReasoningFormat) -> None:
    o, c = fmt.open_id, fmt.close_id
    cases = [
        # (answer parts, prompt opened the block, reasoning, content)
        (
            (o, "\nLet me think: 2 + 2.\n", c, "\n\nIt is 4."),
            False,
            "Let me think: 2 + 2.",
            "It is 4.",
        ),
        (("It is 4, ", "no block."), False, None, "It is 4, no block."),
        (("First.\n\nSecond.\n", c, "\n\nDone"), True, "First.\n\nSecond.", "Done"),
        ((o, "\nstill thinking\n\n"), False, "still thinking", ""),
        ((o, "\n\n", c, "\n\nQuick."), False, "", "Quick."),
        ((o, "é中文 🌍", c, "résumé ", o, "x", c), False, "é中文 🌍", "résumé <think>x</think>"),
    ]
    rng = random.Random(0)
    for parts, opens, reasoning, content in cases:
        ids = answer(qwen3, *parts)
        text = qwen3.decode(ids, skip_special_tokens=True)
        decode = lambda i: qwen3.decode(i, skip_special_tokens=True)  # noqa: E731
        assert split_answer(fmt, decode, text, ids, in_reasoning=opens) == (reasoning, content)
        for _ in range(30):
            got = streamed(qwen3, fmt, ids, rng, opens=opens)
            assert got == (reasoning or "", content, reasoning is not None), parts


@pytest.mark.slow
def test_spelled_markers_are_content(qwen3: Tokenizer, fmt: ReasoningFormat) -> None:
    """Text that spells the markers (typed by a client and echoed back, or written token by
    token) is content: only the sampled marker ids open or close the block."""
    decode = lambda i: qwen3.decode(i, skip_special_tokens=True)  # noqa: E731
    spelled = "<think>I am reasoning</think>\n\nanswer"
    ids = answer(qwen3, spelled)
    assert fmt.open_id not in ids and fmt.close_id not in ids
    assert split_answer(fmt, decode, spelled, ids) == (None, spelled)
    # a real block first, a spelled closing marker inside it stays reasoning
    ids = answer(qwen3, fmt.open_id, "a </think> b", fmt.close_id, "\n\nc <think>")
    text = qwen3.decode(ids, skip_special_tokens=True)
    assert split_answer(fmt, decode, text, ids) == ("a </think> b", "c <think>")
    rng = random.Random(1)
    for _ in range(30):
        assert streamed(qwen3, fmt, ids, rng, opens=False) == ("a </think> b", "c <think>", True)


def test_control_token_markers() -> None:
    """Markers that are control tokens have no text in the answer: found by id all the same."""
    fmt = ReasoningFormat(open_id=900, close_id=901, open_text="", close_text="")
    table = {900: "", 901: ""}

    def decode(ids: list[int]) -> str:
        return "".join(table.get(i, chr(i)) for i in ids)

    ids = [900, *map(ord, "hmm"), 901, *map(ord, "\n\nok")]
    splitter = ReasoningSplitter(fmt, decode)  # type: ignore[arg-type]
    events = [e for i in ids for e in splitter.feed(decode([i]), [i])]
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "hmm"
    assert "".join(e.text for e in events if isinstance(e, AnswerDelta)) == "ok"
    assert isinstance(events[0], ReasoningDelta) and isinstance(events[-1], AnswerDelta)


def test_split_think_and_spelled_markers() -> None:
    assert split_think("<think>\nr\n</think>\n\nc") == ("r", "\n\nc")
    assert split_think("a</think>b</think>c") == ("a", "c")
    assert split_think("plain") == ("", "plain")
    assert spelled_markers("x<think>y</think>") == ["x<", "think>y<", "/think>"]
    assert spelled_markers("plain") == ["plain"]
