"""Tool formats of Llama 3.1, Mistral v3 and Qwen3 against their published chat templates,
rendered by transformers (`render_jinja_template`, what `apply_chat_template(tools=...)` runs)
and tokenized with control tokens parsed, on random conversations with calls and results.

The templates (tests/text/templates/), verbatim:
- `llama-3.1-instruct.jinja`: meta-llama/Llama-3.1-8B-Instruct's template (the same text ships
  with Llama-3.3-70B-Instruct), from llama.cpp's
  models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja.
- `llama-3.2-instruct.jinja`: meta-llama/Llama-3.2-3B-Instruct's template, from llama.cpp's
  models/templates/ (rendered with the date the recipe writes, its fallback "26 Jul 2024": the
  recipe does not write today's date, as transformers' `strftime_now` would).
- `mistral-v3.jinja`: Mistral's "v3" template with tools (mistralai/Mistral-7B-Instruct-v0.3,
  Mistral-Large-Instruct-2407), as quoted in llama.cpp's tests/test-chat-template.cpp.
- `qwen3.jinja`: Qwen/Qwen3-0.6B's template, from llama.cpp's models/templates/.

Mistral is also checked against `mistral_common`, its reference tokenizer (where the two
differ, the recipe follows `mistral_common`). Each family's vocabulary is SmolLM2's with the
family's control tokens added (`write_tokenizer_gguf`), as in test_recipe_families.py.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import gguf
import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from deepinfer.text.recipe import ChatMLRecipe
from deepinfer.text.recipe_families import Llama3Recipe, MistralRecipe, recipe_for
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tools_mistral import TOOL_TOKENS, call_id
from tests.text.test_recipe_families import GEMMA3, LLAMA3_CONTROLS, write_tokenizer_gguf
from tests.text.test_recipe_tools import ARGS, TEXTS, TOOLS
from tests.text.test_recipe_tools import conversation as hermes_conversation

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"
LLAMA31_TOOLS = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()
LLAMA32_TOOLS = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
MISTRAL_V3_TOOLS = (TEMPLATES / "mistral-v3.jinja").read_text()
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
HERMES_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, tuple[str, tuple[str, ...], str, str, tuple[str, ...]]] = {
    # name: (template, control tokens, BOS, EOS, user-defined tokens)
    "llama3.1": (
        LLAMA31_TOOLS,
        (*LLAMA3_CONTROLS, "<|python_tag|>"),
        "<|begin_of_text|>",
        "<|end_of_text|>",
        (),
    ),
    "llama3.2": (
        LLAMA32_TOOLS,
        (*LLAMA3_CONTROLS, "<|python_tag|>"),
        "<|begin_of_text|>",
        "<|end_of_text|>",
        (),
    ),
    "mistral": (
        MISTRAL_V3_TOOLS,
        ("<s>", "</s>", "[INST]", "[/INST]", *TOOL_TOKENS),
        "<s>",
        "</s>",
        (),
    ),
    "qwen3": (QWEN3, (), "<|im_start|>", "<|im_end|>", (*HERMES_TOKENS, "<think>", "</think>")),
    "gemma3": (
        GEMMA3,
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        (),
    ),
}
JSON_RESULTS = ['{"temp": 21}', "42", '[1, "two", {"x": null}]', '{"sky": "clear 日本"}']


@pytest.fixture(scope="module")
def tokenizers(gguf_reader: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("family-tools")
    out = {}
    for name, (template, controls, bos, eos, user) in FAMILIES.items():
        path = root / f"{name}.gguf"
        write_tokenizer_gguf(path, gguf_reader, template, controls, bos, eos, user)
        out[name] = Tokenizer.from_gguf(gguf.GGUFReader(path))
    return out


def render(
    tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """transformers' rendering of the model's template, tokenized with control tokens parsed."""
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert bos is not None and eos is not None
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=tok.chat_template,
        add_generation_prompt=True,
        bos_token=tok.id_to_token(bos),
        eos_token=tok.id_to_token(eos),
        date_string="26 Jul 2024",
    )
    return tok.encode_with_specials(rendered[0])


def specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    return [ToolSpec.from_definition(t["function"]["name"], t) for t in tools]


class Conversation:
    """One conversation built twice: recipe messages and the template's message dicts."""

    def __init__(self) -> None:
        self.ours: list[ChatMessage] = []
        self.theirs: list[dict[str, Any]] = []

    def say(self, role: str, text: str) -> None:
        self.ours.append(ChatMessage(role, text))
        self.theirs.append({"role": role, "content": text})

    def call(self, content: str, calls: list[tuple[str, dict[str, Any], str]]) -> None:
        self.ours.append(
            ChatMessage("assistant", content, tool_calls=tuple(
                ToolCall(n, json.dumps(a, ensure_ascii=False), i) for n, a, i in calls
            ))
        )  # fmt: skip
        self.theirs.append(
            {"role": "assistant", "content": content,
             "tool_calls": [{"type": "function", "id": i, "function": {"name": n, "arguments": a}}
                            for n, a, i in calls]}
        )  # fmt: skip

    def result(self, text: str, id_: str) -> None:
        self.ours.append(ChatMessage("tool", text, tool_call_id=id_))
        self.theirs.append({"role": "tool", "content": text, "tool_call_id": id_})


def llama_conversation(rng: random.Random) -> Conversation:
    """Llama 3.1: one call per assistant turn, each answered by a result."""
    c = Conversation()
    if rng.random() < 0.5:
        c.say("system", "  Be brief. ")
    c.say("user", rng.choice(TEXTS) + rng.choice(["", "  \n"]))
    for turn in range(rng.randint(1, 3)):
        if turn:
            c.say("user", rng.choice(TEXTS))
        name = rng.choice(["get_weather", "now"])
        c.call(rng.choice(["", "Let me look."]), [(name, rng.choice(ARGS), f"c{turn}")])
        c.result(rng.choice(['{"temp": 21}', "sunny\nand warm", "", ' "quoted" \\ ']), "x")
        if rng.random() < 0.5:
            c.say("assistant", " It is sunny. ")
    return c


def mistral_conversation(rng: random.Random, results: list[str] = JSON_RESULTS) -> Conversation:
    """Mistral v3: user and assistant turns in turn, calls and results between them; results
    are JSON documents (where the template and mistral_common agree), ids 9 characters."""
    c = Conversation()
    if rng.random() < 0.5:
        c.say("system", "Be brief.")
    turns = rng.randint(1, 3)
    for turn in range(turns):
        c.say("user", f"{rng.choice(TEXTS)} ({turn})")  # the template finds the last by value
        ids = ["".join(rng.choices(string.ascii_letters + string.digits, k=9)) for _ in range(3)]
        calls = [(rng.choice(["get_weather", "now"]), rng.choice(ARGS), i) for i in ids]
        c.call(rng.choice(["", "Let me look."]), calls[: rng.randint(1, 3)])
        for _, _, i in calls[: len(c.ours[-1].tool_calls)]:
            c.result(rng.choice(results), i)
        if turn < turns - 1 or rng.random() < 0.5:
            c.say("assistant", "It is sunny.")
    if c.ours[-1].role == "assistant" and rng.random() < 0.5:
        c.say("user", "And tomorrow?")
    return c


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])
def test_llama3_equals_its_template(family: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[family]
    recipe = recipe_for(tok)
    assert isinstance(recipe, Llama3Recipe) and recipe.tool_format is not None
    rng = random.Random(31)
    for k in range(60):
        c = llama_conversation(rng)
        tools = TOOLS if k % 4 else None  # calls and results without definitions too
        expected = render(tok, c.theirs, tools)
        assert recipe.encode(c.ours, tools=specs(tools or [])) == expected, c.theirs


@pytest.mark.slow
def test_mistral_equals_its_template(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["mistral"]
    recipe = recipe_for(tok)
    assert isinstance(recipe, MistralRecipe) and recipe.tool_format is not None
    rng = random.Random(3)
    for k in range(60):
        c = mistral_conversation(rng)
        tools = TOOLS if k % 4 else None
        expected = render(tok, system_in_last_user(c.theirs), tools)
        assert recipe.encode(c.ours, tools=specs(tools or [])) == expected, c.theirs


def system_in_last_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system prompt moved into the last user message, as mistral_common writes it (the
    template writes it there only when that message is the last one)."""
    if messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    last = max(k for k, m in enumerate(rest) if m["role"] == "user")
    rest[last]["content"] = f"{system}\n\n{rest[last]['content']}"
    return rest


MISTRAL_TOOLS = [
    TOOLS[0],
    {"type": "function", "function": {"name": "now", "description": "The time, now.",
                                      "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


def mistral_common_ids(tok: Tokenizer, c: Conversation, tools: list[dict[str, Any]]) -> list[int]:
    """mistral_common's v3 encoding of the conversation. Its text tokenizer is this vocabulary
    encoding each text as SentencePiece does, with the dummy-prefix space (the space the
    template writes after each control token)."""
    instruct = pytest.importorskip("mistral_common.tokens.tokenizers.instruct")
    from mistral_common.protocol.instruct import messages as mc
    from mistral_common.protocol.instruct import tool_calls as mt
    from mistral_common.tokens.tokenizers.base import InstructRequest

    class Raw:
        bos_id, eos_id, model_settings_builder = tok.bos_token_id, tok.eos_token_id, None

        def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
            return [self.bos_id] * bos + tok.encode(" " + text) + [self.eos_id] * eos

        def get_special_token(self, name: str) -> int:
            token_id = tok.token_to_id(name)
            return -1 if token_id is None else token_id

        def decode(self, ids: list[int], special_token_policy: Any = None) -> str:
            return tok.decode(ids)

        def _to_string(self, ids: list[int]) -> str:
            return tok.decode(ids)

    system = None
    messages: list[Any] = []
    for m in c.ours:
        if m.role == "system":
            system = m.content
        elif m.role == "user":
            messages.append(mc.UserMessage(content=m.content))
        elif m.role == "tool":
            messages.append(mc.ToolMessage(content=m.content, tool_call_id=m.tool_call_id))
        elif m.tool_calls:
            calls = [
                mt.ToolCall(id=t.id, function=mt.FunctionCall(name=t.name, arguments=t.arguments))
                for t in m.tool_calls
            ]
            messages.append(mc.AssistantMessage(tool_calls=calls))
        else:
            messages.append(mc.AssistantMessage(content=m.content))
    available = [mt.Tool(function=mt.Function(**t["function"])) for t in tools]
    request = InstructRequest(messages=messages, available_tools=available, system_prompt=system)
    return list(instruct.InstructTokenizerV3(Raw()).encode_instruct(request).tokens)


@pytest.mark.slow
def test_mistral_equals_mistral_common(tokenizers: dict[str, Tokenizer]) -> None:
    """Mistral's reference tokenization of tools, on random conversations whose results are
    JSON or plain text (which the template cannot write as JSON)."""
    pytest.importorskip("mistral_common")
    tok = tokenizers["mistral"]
    recipe = recipe_for(tok)
    rng = random.Random(4)
    for _ in range(40):
        c = mistral_conversation(rng, results=[*JSON_RESULTS, "sunny", 'a "quoted" line\n'])
        expected = mistral_common_ids(tok, c, MISTRAL_TOOLS)
        assert recipe.encode(c.ours, tools=specs(MISTRAL_TOOLS)) == expected, c.theirs


@pytest.mark.slow
def test_mistral_follows_mistral_common_where_the_template_does_not(
    tokenizers: dict[str, Tokenizer],
) -> None:
    """A result that is not JSON is a JSON string, and a client's call id is cut to 9 letters
    and digits, the same for the call and its result: the template rendered with exactly those
    values gives the same ids."""
    tok = tokenizers["mistral"]
    c = Conversation()
    c.say("user", "Weather?")
    c.call("", [("get_weather", {"city": "Paris"}, "call_0123456789abcdef")])
    c.result('sunny, "warm"\n', "call_0123456789abcdef")
    theirs = json.loads(json.dumps(c.theirs))
    theirs[1]["tool_calls"][0]["id"] = theirs[2]["tool_call_id"] = "789abcdef"
    theirs[2]["content"] = json.dumps('sunny, "warm"\n')
    assert call_id("call_0123456789abcdef") == "789abcdef" and call_id(None) == "0" * 9
    assert recipe_for(tok).encode(c.ours, tools=specs(TOOLS)) == render(tok, theirs, TOOLS)


@pytest.mark.slow
def test_qwen3_equals_its_template(tokenizers: dict[str, Tokenizer]) -> None:
    """Qwen3's tool turns are Qwen2.5's without a default system prompt. A conversation is cut
    before a last assistant turn, which Qwen3 writes with a <think> block (the reasoning
    format's, not the tool format's)."""
    tok = tokenizers["qwen3"]
    recipe = recipe_for(tok)
    assert isinstance(recipe, ChatMLRecipe) and recipe.default_system_prompt is None
    assert set(recipe.tool_format.marker_ids) == set(HERMES_TOKENS)
    rng = random.Random(3)
    for _ in range(60):
        ours, theirs = hermes_conversation(rng)
        if ours[-1].role == "assistant":
            ours, theirs = ours[:-1], theirs[:-1]
        expected = render(tok, theirs, TOOLS)
        assert recipe.encode(ours, tools=specs(TOOLS)) == expected, theirs
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    expected = render(tok, [{"role": m.role, "content": m.content} for m in messages], TOOLS)
    assert recipe.encode(messages, tools=specs(TOOLS)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.1", "mistral"])
def test_typed_control_tokens_stay_text(family: str, tokenizers: dict[str, Tokenizer]) -> None:
    """Every control token typed into every field a client fills (contents, results, arguments,
    names, ids, definitions): the prompt's control ids are those of the same conversation
    without the payload."""
    tok = tokenizers[family]
    recipe = recipe_for(tok)

    def conversation(payload: str) -> tuple[list[ChatMessage], list[ToolSpec]]:
        args = json.dumps({"q": payload}, ensure_ascii=False)
        messages = [
            ChatMessage("system", f"s{payload}"),
            ChatMessage("user", f"u{payload}", name=payload or None),
            ChatMessage("assistant", payload, tool_calls=(ToolCall("f", args, f"id{payload}"),)),
            ChatMessage("tool", f"r{payload}", tool_call_id=f"id{payload}"),
            ChatMessage("assistant", f"a{payload}"),
            ChatMessage("user", f"v{payload}"),
        ]
        tool = {"type": "function", "function": {"name": "f", "description": f"d{payload}"}}
        return messages, [ToolSpec.from_definition("f", tool)]

    def controls(payload: str) -> list[int]:
        messages, tools = conversation(payload)
        return [i for i in recipe.encode(messages, tools=tools) if i in tok.special_token_ids]

    expected = controls("")
    for i in sorted(tok.special_token_ids):
        token = tok.id_to_token(i)
        assert token is not None
        for payload in (token, f"x{token}y", f"{token}\n{token}", token * 3):
            assert controls(payload) == expected, (family, payload)


@pytest.mark.slow
def test_llama31_refusals(tokenizers: dict[str, Tokenizer]) -> None:
    recipe = recipe_for(tokenizers["llama3.1"])
    two = (ToolCall("now", "{}", "a"), ToolCall("now", "{}", "b"))
    messages = [ChatMessage("user", "u"), ChatMessage("assistant", "", tool_calls=two)]
    with pytest.raises(InvalidRequestError) as raised:
        recipe.encode(messages)
    assert raised.value.param == "messages[1].tool_calls"
    with pytest.raises(InvalidRequestError) as raised:
        recipe.encode([ChatMessage("system", "s")], tools=specs(TOOLS))
    assert raised.value.param == "messages[1]"


@pytest.mark.slow
def test_mistral_turns_out_of_order_are_refused(tokenizers: dict[str, Tokenizer]) -> None:
    """Results and calls stand outside the alternation; a user turn right after results does
    not (the template raises too)."""
    recipe = recipe_for(tokenizers["mistral"])
    c = Conversation()
    c.say("user", "u")
    c.call("", [("now", {}, "abcdefghi")])
    c.result("1", "abcdefghi")
    c.say("user", "v")
    with pytest.raises(InvalidRequestError) as raised:
        recipe.encode(c.ours)
    assert raised.value.param == "messages[3].role"


@pytest.mark.slow
def test_gemma_refuses_tools_naming_its_family(tokenizers: dict[str, Tokenizer]) -> None:
    recipe = recipe_for(tokenizers["gemma3"])
    with pytest.raises(InvalidRequestError, match="Gemma") as raised:
        recipe.encode([ChatMessage("user", "u")], tools=specs(TOOLS))
    assert raised.value.param == "tools"
