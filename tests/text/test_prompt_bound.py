"""Prompts -> token ids (`deepinfer.engine.prompts`) on the real SmolLM2 tokenizer: a prompt whose
bytes alone prove it longer than the context is refused untokenized; long conversations are
tokenized off the event loop."""

from __future__ import annotations

import threading
import time

import pytest

from deepinfer.engine.prompts import encode_prompt
from deepinfer.errors import ContextLengthError, PromptTooLongError
from deepinfer.text.recipe import ChatMessage, ChatRecipe
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer

MAX_MODEL_LEN = 8192


@pytest.fixture
def counted(
    smollm_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> tuple[ChatRecipe, list[int]]:
    """The recipe, and a list that grows by one entry (the thread id) per tokenizer call."""
    recipe = recipe_for(smollm_tokenizer)
    calls: list[int] = []
    encode = Tokenizer.encode

    def counting(self: Tokenizer, text: str) -> list[int]:
        calls.append(threading.get_ident())
        return encode(self, text)

    monkeypatch.setattr(Tokenizer, "encode", counting)
    return recipe, calls


@pytest.mark.slow
async def test_a_4mb_prompt_is_refused_without_tokenizing(
    counted: tuple[ChatRecipe, list[int]],
) -> None:
    recipe, calls = counted
    text = "lorem ipsum " * (4_000_000 // 12)
    started = time.perf_counter()
    with pytest.raises(ContextLengthError) as refused:
        await encode_prompt(recipe, text, max_model_len=MAX_MODEL_LEN)
    assert isinstance(refused.value, PromptTooLongError)
    assert refused.value.param == "prompt"
    assert f"at least {-(-len(text) // 81)} tokens" in refused.value.message
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", text)]
    with pytest.raises(PromptTooLongError, match="context is 8192 tokens"):
        await encode_prompt(recipe, messages, max_model_len=MAX_MODEL_LEN)
    assert calls == []
    assert time.perf_counter() - started < 1.0  # tokenizing it would take seconds


@pytest.mark.slow
async def test_the_bound_is_the_longest_token(
    counted: tuple[ChatRecipe, list[int]], smollm_tokenizer: Tokenizer
) -> None:
    """Exactly max_model_len * max_token_bytes bytes may still fit: it is tokenized (and here
    turns out longer); one byte more cannot fit."""
    recipe, calls = counted
    assert smollm_tokenizer.max_token_bytes == 81
    fits = "é" * (100 * 81 // 2) + "a" * (100 * 81 % 2)
    assert len(fits.encode()) == 100 * 81
    assert len(await encode_prompt(recipe, fits, max_model_len=100)) > 100
    assert len(calls) == 1
    with pytest.raises(PromptTooLongError, match="at least 101 tokens"):
        await encode_prompt(recipe, fits + "a", max_model_len=100)
    with pytest.raises(PromptTooLongError):
        await encode_prompt(recipe, list(range(101)), max_model_len=100)
    assert len(calls) == 1
    assert await encode_prompt(recipe, [5, 6], max_model_len=100) == [5, 6]


@pytest.mark.slow
async def test_long_conversations_are_tokenized_off_the_loop(
    counted: tuple[ChatRecipe, list[int]],
) -> None:
    recipe, calls = counted
    loop_thread = threading.get_ident()
    short = [ChatMessage("user", "hello")]
    long = [ChatMessage("user", "word " * 2000), ChatMessage("assistant", "ok " * 2000)]
    assert await encode_prompt(recipe, short, max_model_len=MAX_MODEL_LEN)
    assert set(calls) == {loop_thread}  # short ones are not worth a thread hop
    calls.clear()
    ids = await encode_prompt(recipe, long, max_model_len=MAX_MODEL_LEN)
    assert calls and loop_thread not in calls
    assert ids == recipe.encode(long)
