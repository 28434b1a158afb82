"""How a chat prompt ends, and whether the model thinks: the request fields behind them.

OpenAI chat and `/tokenize` take vLLM's `add_generation_prompt`, `continue_final_message` (the
final assistant message is continued, not closed: prefill) and `chat_template_kwargs`, of which
the recipe understands `enable_thinking`; Anthropic's trailing assistant message is a prefill,
and its `thinking` field the same switch. Any other template keyword is a 400 naming it: the
recipe renders no template, so a keyword it does not know would be silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from deepinfer.api.http.errors import is_set, unsupported

TEMPLATE_KWARGS = ("enable_thinking",)
"""The `chat_template_kwargs` keys the recipe understands."""


@dataclass(frozen=True)
class PromptOptions:
    """What the recipe is asked besides the messages and tools."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """The final assistant message is left open and the answer continues it (prefill)."""
    enable_thinking: bool | None = None
    """A reasoning model's switch (None: the template's default); ignored by other models."""


DEFAULT_PROMPT = PromptOptions()


def openai_prompt_options(
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    chat_template_kwargs: msgspec.Raw,
    *,
    closed_prompts: bool = False,
) -> PromptOptions:
    """vLLM's fields, validated. `closed_prompts`: a conversation may end closed, with neither a
    generation prompt nor a turn to continue (`/tokenize`); chat refuses it, since the model
    would have no turn to answer in."""
    kwargs = template_kwargs(chat_template_kwargs)
    enable_thinking = kwargs.get("enable_thinking")
    if continue_final_message:
        if add_generation_prompt:
            raise unsupported(
                "continue_final_message",
                "cannot be combined with add_generation_prompt: true (the final message is "
                "continued, no new turn is opened); send add_generation_prompt: false",
            )
        return PromptOptions(False, True, enable_thinking)
    if add_generation_prompt is False and not closed_prompts:
        raise unsupported(
            "add_generation_prompt",
            "false needs continue_final_message: true (the answer continues the final "
            "assistant message); without it the prompt would end with no turn to answer in",
        )
    return PromptOptions(add_generation_prompt is not False, False, enable_thinking)


def template_kwargs(raw: msgspec.Raw) -> dict[str, Any]:
    """`chat_template_kwargs` decoded: only the keys the recipe understands, typed."""
    if not is_set(raw):
        return {}
    try:
        kwargs = msgspec.json.decode(raw, type=dict[str, Any])
    except msgspec.ValidationError:
        raise unsupported("chat_template_kwargs", "must be an object") from None
    for key, value in kwargs.items():
        if key not in TEMPLATE_KWARGS:
            raise unsupported(
                f"chat_template_kwargs.{key}",
                f"unknown template keyword; this server's chat recipe understands "
                f"{', '.join(TEMPLATE_KWARGS)}",
            )
        if not isinstance(value, bool) and value is not None:
            raise unsupported(f"chat_template_kwargs.{key}", "must be true or false")
    return kwargs
