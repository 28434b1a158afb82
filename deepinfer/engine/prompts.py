"""Prompts in any accepted form (text, chat messages, token ids) -> token ids."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deepinfer.errors import InvalidRequestError
from deepinfer.text.recipe import ChatMessage, ChatRecipe, ReasoningEffort

Prompt = str | Sequence[int] | Sequence[ChatMessage]
_LONG_TEXT_CHARS = 8192
"""Prompts longer than this are tokenized on a worker thread, not on the loop."""


async def encode_prompt(
    recipe: ChatRecipe, prompt: Prompt, reasoning_effort: ReasoningEffort | None = None
) -> list[int]:
    """Text is plain text (specials typed in it stay text), chat messages go through the
    recipe, token ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        if len(prompt) > _LONG_TEXT_CHARS:
            return await asyncio.to_thread(recipe.encode_prompt, prompt)
        return recipe.encode_prompt(prompt)
    items = list(prompt)
    if items and isinstance(items[0], ChatMessage):
        messages = [m for m in items if isinstance(m, ChatMessage)]
        return recipe.encode(messages, reasoning_effort=reasoning_effort)
    return check_token_ids(items, recipe.tokenizer.vocab_size)


def check_token_ids(items: list[object], vocab_size: int) -> list[int]:
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in items
    ):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", param="prompt"
        )
    return [int(t) for t in items]  # type: ignore[call-overload]
