"""The chat recipe against the model's own Jinja chat template, rendered and tokenized."""

from __future__ import annotations

import functools
import random
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepinfer.errors import InvalidRequestError, ModelLoadError
from deepinfer.text.recipe import (
    ChatMessage,
    ChatMLRecipe,
    ChatRecipe,
    PlainRecipe,
    find_default_system_prompt,
    reasoning_effort_line,
)
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer
from tests.text.text_samples import SAMPLES

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
BENIGN = [s for s in SAMPLES if "<|" not in s and "<repo" not in s]


@functools.cache
def compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render(tok: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The reference: the template rendered as transformers does, then tokenized with specials."""
    text = compiled(tok.chat_template or "").render(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=add_generation_prompt,
    )
    return tok.encode_with_specials(text)


def random_conversation(rng: random.Random) -> list[ChatMessage]:
    messages = []
    if rng.random() < 0.5:
        messages.append(ChatMessage("system", rng.choice(BENIGN)))
    for i in range(rng.randint(1, 6)):
        role = rng.choice(["user", "assistant", "tool"]) if i else "user"
        text = rng.choice(["", " ", "\n"]).join(rng.sample(BENIGN, rng.randint(1, 3)))
        messages.append(ChatMessage(role, text))
    return messages


@pytest.fixture(scope="module")
def recipe(smollm_tokenizer: Tokenizer) -> ChatRecipe:
    return recipe_for(smollm_tokenizer)


@pytest.mark.slow
def test_equals_jinja_template(smollm_tokenizer: Tokenizer, recipe: ChatRecipe) -> None:
    rng = random.Random(0)
    for _ in range(300):
        messages = random_conversation(rng)
        generation = rng.random() < 0.7
        expected = render(smollm_tokenizer, messages, generation)
        assert recipe.encode(messages, add_generation_prompt=generation) == expected, messages


@pytest.mark.slow
def test_default_system_prompt(smollm_tokenizer: Tokenizer, recipe: ChatRecipe) -> None:
    assert isinstance(recipe, ChatMLRecipe)
    assert recipe.default_system_prompt == SMOLLM_SYSTEM
    assert recipe.end_of_turn_ids == frozenset({0, 2})
    ids = recipe.encode([ChatMessage("user", "hi")])
    assert smollm_tokenizer.decode(ids) == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert recipe.encode([]) == render(smollm_tokenizer, [], True)


@pytest.mark.slow
@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort(smollm_tokenizer: Tokenizer, recipe: ChatRecipe, effort: Any) -> None:
    line = reasoning_effort_line(effort)
    assert line == f"Reasoning effort: {effort}."
    user = ChatMessage("user", "hi")
    with_default = recipe.encode([user], reasoning_effort=effort)
    assert with_default == render(
        smollm_tokenizer, [ChatMessage("system", f"{SMOLLM_SYSTEM}\n\n{line}"), user], True
    )
    own = recipe.encode([ChatMessage("system", "Be brief."), user], reasoning_effort=effort)
    assert own == render(
        smollm_tokenizer, [ChatMessage("system", f"Be brief.\n\n{line}"), user], True
    )
    with pytest.raises(InvalidRequestError):
        recipe.encode([user], reasoning_effort="extreme")  # type: ignore[arg-type]


@pytest.mark.slow
def test_name_is_a_plain_prefix(smollm_tokenizer: Tokenizer, recipe: ChatRecipe) -> None:
    ids = recipe.encode(
        [ChatMessage("user", "hi", name="alice"), ChatMessage("tool", "42", "calc")]
    )
    expected = [ChatMessage("user", "alice: hi"), ChatMessage("tool", "calc: 42")]
    assert ids == render(smollm_tokenizer, expected, True)


@pytest.mark.slow
def test_unknown_role_names_the_field(recipe: ChatRecipe) -> None:
    with pytest.raises(InvalidRequestError) as info:
        recipe.encode([ChatMessage("user", "a"), ChatMessage("developer", "b")])
    assert info.value.param == "messages[1].role"


@pytest.mark.slow
def test_encode_prompt(smollm_tokenizer: Tokenizer, recipe: ChatRecipe) -> None:
    text = "Once upon a time <|im_start|>"
    assert recipe.encode_prompt(text) == smollm_tokenizer.encode(text)  # add_bos is False


QWEN_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
)


def test_find_default_system_prompt() -> None:
    assert find_default_system_prompt(QWEN_TEMPLATE) == "You are Qwen, created by Alibaba Cloud."
    no_default = "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>' }}"
    assert find_default_system_prompt(no_default) is None


class FakeTokenizer:
    """Enough of a Tokenizer to pick a recipe: characters as ids."""

    def __init__(self, chat_template: str | None, add_bos: bool = False) -> None:
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token_id = 7
        self.eos_token_id = 8
        self.special_token_ids = frozenset({7, 8})

    def token_to_id(self, token: str) -> int | None:
        return None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_plain_fallback_without_template() -> None:
    recipe = recipe_for(FakeTokenizer(None, add_bos=True))  # type: ignore[arg-type]
    assert isinstance(recipe, PlainRecipe)
    ids = recipe.encode([ChatMessage("system", "S"), ChatMessage("user", "U")])
    assert ids == [7] + [ord(c) for c in "System: S\n\nUser: U\n\nAssistant:"]
    assert recipe.encode_prompt("ab") == [7, 97, 98]


def test_unsupported_template_is_refused() -> None:
    llama3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"
    with pytest.raises(ModelLoadError, match="ChatML"):
        recipe_for(FakeTokenizer(llama3))  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="control tokens"):
        recipe_for(FakeTokenizer(QWEN_TEMPLATE))  # type: ignore[arg-type]
