"""Prompts in any accepted form (text, chat messages, token ids) -> token ids.

Nothing proportional to a prompt's size runs on the event loop: long texts and long
conversations are tokenized on the long-text thread (`off_loop`, `text/long_texts.py`). A prompt whose size alone proves it longer than
the context is refused before it is tokenized at all (`check_prompt_fits`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from deepinfer.errors import InvalidRequestError, PromptTooLongError
from deepinfer.text import long_texts
from deepinfer.text.recipe import ChatMessage, ChatRecipe, ReasoningEffort

Prompt = str | Sequence[int] | Sequence[ChatMessage]
T = TypeVar("T")


async def off_loop(size: int, fn: Callable[[], T]) -> T:
    """`fn()`, on the long-text thread when `size` (characters, or ids) is past
    `LONG_TEXT_CHARS`, else here (handing a short text to a thread costs more than encoding it)."""
    if size > long_texts.LONG_TEXT_CHARS:
        return await asyncio.get_running_loop().run_in_executor(long_texts.executor(), fn)
    return fn()


def check_prompt_fits(
    texts: Sequence[str], max_token_bytes: int | None, max_model_len: int, param: str
) -> None:
    """Refuse texts whose UTF-8 size proves they hold more than `max_model_len` tokens (each
    token stands for at most `max_token_bytes` bytes); costs O(bytes) in C, no tokenizing."""
    if max_token_bytes is None:
        return
    budget_bytes = max_model_len * max_token_bytes
    num_chars = sum(len(t) for t in texts)
    if num_chars <= budget_bytes // 4:  # a character is at most 4 bytes
        return
    num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if num_bytes > budget_bytes:
        raise PromptTooLongError(-(-num_bytes // max_token_bytes), max_model_len, param)


def is_chat(prompt: Prompt) -> bool:
    """Chat messages (encoded by the recipe), not text or token ids."""
    return not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], ChatMessage)


async def encode_prompt(
    recipe: ChatRecipe,
    prompt: Prompt,
    reasoning_effort: ReasoningEffort | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Text is plain text (specials typed in it stay text), chat messages go through the
    recipe, token ids are checked against the vocabulary. With `max_model_len`, a prompt that
    cannot fit is refused (`ContextLengthError`) before it is tokenized."""
    limit = max_model_len
    max_token_bytes = recipe.tokenizer.max_token_bytes
    if isinstance(prompt, str):
        if limit is not None:
            check_prompt_fits([prompt], max_token_bytes, limit, "prompt")
        return await off_loop(len(prompt), lambda: recipe.encode_prompt(prompt))
    items = list(prompt)
    if items and isinstance(items[0], ChatMessage):
        messages = [m for m in items if isinstance(m, ChatMessage)]
        texts = [m.content for m in messages] + [m.name for m in messages if m.name]
        if limit is not None:
            check_prompt_fits(texts, max_token_bytes, limit, "messages")
        size = sum(len(t) for t in texts)
        return await off_loop(
            size, lambda: recipe.encode(messages, reasoning_effort=reasoning_effort)
        )
    if limit is not None and len(items) > limit:
        raise PromptTooLongError(len(items), limit, "prompt")
    return check_token_ids(items, recipe.tokenizer.vocab_size)


def check_token_ids(items: list[object], vocab_size: int) -> list[int]:
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in items
    ):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", param="prompt"
        )
    return [int(t) for t in items]  # type: ignore[call-overload]


async def encode_prediction(recipe: ChatRecipe, text: str, max_model_len: int) -> tuple[int, ...]:
    """A prediction's token ids (the text as an answer's content: no BOS, control-token text
    stays plain), for drafts (`scheduler/prediction.py`). A prediction whose size proves it
    longer than the context is refused before it is tokenized, one that is by its tokens after."""
    max_token_bytes = recipe.tokenizer.max_token_bytes
    if max_token_bytes is not None:
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > max_model_len * max_token_bytes:
            raise _prediction_too_long(-(-num_bytes // max_token_bytes), max_model_len)
    ids = await off_loop(len(text), lambda: recipe.tokenizer.encode(text))
    if len(ids) > max_model_len:
        raise _prediction_too_long(len(ids), max_model_len)
    return tuple(ids)


def _prediction_too_long(num_tokens: int, max_model_len: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"the prediction is at least {num_tokens} tokens, more than this model's context of "
        f"{max_model_len}; send a shorter one",
        param="prediction",
    )
