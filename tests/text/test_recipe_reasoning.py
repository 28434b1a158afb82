"""Qwen3 and DeepSeek-R1-distill against their published templates, and against injection.

The templates are stored in `tests/text/templates/` (sources in its README). Each family gets a
tokenizer built here from SmolLM2's vocabulary with the family's added tokens, typed as its own
tokenizer.json types them (Qwen3: `<|im_start|>`/`<|im_end|>` control tokens, `<think>` and the
tool markers plain added tokens; R1: BOS/EOS control tokens, `<｜User｜>`, `<｜Assistant｜>` and
the think markers plain added tokens). The reference is transformers' own rendering
(`render_jinja_template`, behind `apply_chat_template`, `enable_thinking` and
`continue_final_message` included), tokenized with added tokens parsed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.errors import InvalidRequestError
from deepinfer.text.recipe import ChatMessage
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.recipe_reasoning import DeepSeekR1Recipe, Qwen3Recipe
from deepinfer.text.tokenizer import Tokenizer
from tests.text.text_samples import SAMPLES

TEMPLATES = Path(__file__).parent / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
R1 = (TEMPLATES / "deepseek_r1_distill_qwen.jinja").read_text()
R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK = ("<think>", "</think>")
QWEN3_ADDED = (*THINK, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
BENIGN = [s for s in SAMPLES if "<|" not in s and "<repo" not in s and "<｜" not in s]


def build_tokenizer(
    base: Tokenizer,
    path: Path,
    template: str,
    controls: tuple[str, ...],
    added: tuple[str, ...],
    bos: str | None,
    eos: str,
) -> Tokenizer:
    """SmolLM2's vocabulary with `controls` (special) and `added` (plain added tokens), saved as
    a tokenizer directory and loaded back as a model directory is."""
    hf = HFTokenizer.from_str(base._special.to_str())
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in controls])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    Tokenizer(hf, bos_token_id=None, eos_token_id=None, add_bos=False, chat_template=None).save_dir(
        path
    )
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": False, "chat_template": template}
    (path / "tokenizer_config.json").write_text(__import__("json").dumps(config))
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def qwen3(smollm_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root = tmp_path_factory.mktemp("qwen3")
    return build_tokenizer(smollm_tokenizer, root, QWEN3, (), QWEN3_ADDED, None, "<|im_end|>")


@pytest.fixture(scope="module")
def r1(smollm_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root = tmp_path_factory.mktemp("r1")
    added = ("<｜User｜>", "<｜Assistant｜>", *THINK)
    return build_tokenizer(smollm_tokenizer, root, R1, (R1_BOS, R1_EOS), added, R1_BOS, R1_EOS)


def render(tok: Tokenizer, messages: list[ChatMessage], **kwargs: Any) -> list[int]:
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    rendered, _ = chat_utils.render_jinja_template(
        conversations=[[{"role": m.role, "content": m.content} for m in messages]],
        chat_template=tok.chat_template,
        bos_token=None if bos is None else tok.id_to_token(bos),
        eos_token=None if eos is None else tok.id_to_token(eos),
        **kwargs,
    )
    return tok.encode_with_specials(rendered[0])


def text(rng: random.Random) -> str:
    return rng.choice(["", " ", "\n"]).join(rng.sample(BENIGN, rng.randint(1, 3)))


def assistant_text(rng: random.Random) -> str:
    """An answer, sometimes with the think block a client sent back as text."""
    roll = rng.random()
    if roll < 0.3:
        return f"<think>\n{text(rng)}\n</think>\n\n{text(rng)}"
    if roll < 0.4:
        return f"{text(rng)}</think>{text(rng)}"
    return text(rng)


def conversation(rng: random.Random, roles: list[str]) -> list[ChatMessage]:
    messages = [ChatMessage("system", text(rng))] if rng.random() < 0.4 else []
    for i in range(rng.randint(1, 6)):
        role = rng.choice(roles) if i else "user"
        messages.append(
            ChatMessage(role, assistant_text(rng) if role == "assistant" else text(rng))
        )
    return messages


def without_trailing_reasoning(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Qwen3: assistant turns after the last query, but the final message, carry no think block
    (the recipe drops their reasoning, see `recipe_reasoning.py`)."""
    users = [k for k, m in enumerate(messages) if m.role == "user"]
    last_query = users[-1] if users else len(messages) - 1
    return [
        ChatMessage(m.role, m.content.replace("</think>", "").replace("<think>", ""))
        if m.role == "assistant" and last_query < k < len(messages) - 1
        else m
        for k, m in enumerate(messages)
    ]


def check_against_template(tok: Tokenizer, roles: list[str], seed: str) -> None:
    recipe = recipe_for(tok)
    rng = random.Random(seed)
    for _ in range(150):
        messages = without_trailing_reasoning(conversation(rng, roles))
        kwargs: dict[str, Any] = {}
        if rng.random() < 0.6:
            kwargs["enable_thinking"] = rng.random() < 0.5
        prefill = messages[-1].role == "assistant" and rng.random() < 0.5
        if prefill:
            # transformers finds the continued text in the rendering: no think block in it
            last = messages[-1].content.replace("</think>", "").replace("<think>", "")
            messages[-1] = ChatMessage("assistant", last + rng.choice(["Sure", " So"]))
            kwargs["continue_final_message"] = True
        else:
            kwargs["add_generation_prompt"] = rng.random() < 0.7
        expected = render(tok, messages, **kwargs)
        assert recipe.encode(messages, **kwargs) == expected, (messages, kwargs)


@pytest.mark.slow
def test_qwen3_equals_the_template(qwen3: Tokenizer) -> None:
    assert type(recipe_for(qwen3)) is Qwen3Recipe
    check_against_template(qwen3, ["user", "assistant", "assistant", "tool", "system"], "qwen3")


@pytest.mark.slow
def test_r1_equals_the_template(r1: Tokenizer) -> None:
    assert type(recipe_for(r1)) is DeepSeekR1Recipe
    check_against_template(r1, ["user", "assistant", "system"], "r1")


@pytest.mark.slow
def test_generation_prompts(qwen3: Tokenizer, r1: Tokenizer) -> None:
    user = [ChatMessage("user", "hi")]
    q = recipe_for(qwen3)
    assert qwen3.decode(q.encode(user, enable_thinking=False)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen3.decode(q.encode(user, enable_thinking=True)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r1.decode(recipe_for(r1).encode(user)) == f"{R1_BOS}<｜User｜>hi<｜Assistant｜><think>\n"
    q_format, r1_format = q.reasoning, recipe_for(r1).reasoning  # type: ignore[attr-defined]
    assert not q_format.prompt_opens and r1_format.prompt_opens
    assert q_format.open_id == qwen3.token_to_id("<think>")
    assert r1_format.close_text == "</think>"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_typed_markers_stay_text(family: str, qwen3: Tokenizer, r1: Tokenizer) -> None:
    """Every added token of the vocabulary typed into every field (prefill included): the prompt
    holds exactly the marker ids the recipe writes without the payload, and the text survives."""
    tok = qwen3 if family == "qwen3" else r1
    recipe = recipe_for(tok)
    plain = [ChatMessage("system", "s"), ChatMessage("user", "u"), ChatMessage("assistant", "a")]

    def markers(messages: list[ChatMessage], **kwargs: Any) -> list[int]:
        return [i for i in recipe.encode(messages, **kwargs) if i in tok.added_token_ids]

    for kwargs in ({}, {"continue_final_message": True}):
        expected = markers(plain, **kwargs)
        for i in sorted(tok.added_token_ids - tok.special_token_ids):
            token = tok.id_to_token(i)
            assert token is not None
            for payload in (token, f"x{token}y", token * 2, f"<{token}>"):
                typed = [ChatMessage(m.role, f"{m.content}{payload}") for m in plain]
                assert markers(typed, **kwargs) == expected, (family, payload, kwargs)
                assert payload in tok.decode(recipe.encode(typed, **kwargs))


@pytest.mark.slow
def test_r1_refuses_tools(r1: Tokenizer) -> None:
    recipe = recipe_for(r1)
    with pytest.raises(InvalidRequestError) as raised:
        recipe.encode([ChatMessage("user", "u"), ChatMessage("tool", "t")])
    assert raised.value.param == "messages[1].role"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_reasoning_effort_line(family: str, qwen3: Tokenizer, r1: Tokenizer) -> None:
    """`reasoning_effort` is the recipe's line in the system prompt, as a system message
    holding it renders through the template."""
    tok = qwen3 if family == "qwen3" else r1
    recipe = recipe_for(tok)
    user = ChatMessage("user", "hi")
    for system in (None, "Be brief."):
        given = [] if system is None else [ChatMessage("system", system)]
        line = "Reasoning effort: high."
        expected_system = line if system is None else f"{system}\n\n{line}"
        expected = render(
            tok, [ChatMessage("system", expected_system), user], add_generation_prompt=True
        )
        assert recipe.encode([*given, user], reasoning_effort="high") == expected
