"""The tool format against a Qwen2.5-style Jinja tool template, rendered and tokenized."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from deepinfer.text.recipe import ChatMLRecipe
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tools import DEFAULT_HEAD, DEFAULT_TAIL, ToolFormat

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
ARGS = [{"city": "Paris"}, {"city": "Zürich", "days": 3}, {}, {"q": 'a "quoted" 日本 line\n'}]
RESULTS = ['{"temp": 21}', "sunny\nand warm", "", "42 °C, wind {n: 3}"]
TEXTS = ["What is the weather in Paris?", "Let me look.", "Thanks! And tomorrow?", "Sure."]


def render(tok: Tokenizer, template: str, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """transformers' rendering: its `tojson` (json.dumps, ensure_ascii=False), then tokenized."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    text = env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True
    )
    return tok.encode_with_specials(text)


def conversation(rng: random.Random) -> tuple[list[ChatMessage], list[dict[str, Any]]]:
    """A random tool conversation, as recipe messages and as template messages."""
    ours: list[ChatMessage] = []
    theirs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        ours.append(ChatMessage("system", "Be brief."))
        theirs.append({"role": "system", "content": "Be brief."})
    for turn in range(rng.randint(1, 3)):
        text = rng.choice(TEXTS)
        ours.append(ChatMessage("user", text))
        theirs.append({"role": "user", "content": text})
        calls = [
            (rng.choice(["get_weather", "now"]), rng.choice(ARGS)) for _ in range(rng.randint(1, 3))
        ]
        content = rng.choice(["", "Let me look."])
        ours.append(
            ChatMessage("assistant", content, tool_calls=tuple(
                ToolCall(n, json.dumps(a, ensure_ascii=False), f"c{turn}{k}")
                for k, (n, a) in enumerate(calls)
            ))
        )  # fmt: skip
        theirs.append(
            {"role": "assistant", "content": content,
             "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                            for n, a in calls]}
        )  # fmt: skip
        for k in range(len(calls)):
            result = rng.choice(RESULTS)
            ours.append(ChatMessage("tool", result, tool_call_id=f"c{turn}{k}"))
            theirs.append({"role": "tool", "content": result})
        if rng.random() < 0.5:
            ours.append(ChatMessage("assistant", "It is sunny."))
            theirs.append({"role": "assistant", "content": "It is sunny."})
    return ours, theirs


def specs() -> list[ToolSpec]:
    return [ToolSpec.from_definition(t["function"]["name"], t) for t in TOOLS]


@pytest.fixture(scope="module")
def qwen_style(smollm_tokenizer: Tokenizer) -> ChatMLRecipe:
    """SmolLM2's vocabulary with a Qwen2.5 template: the tool format is read from it."""
    recipe = recipe_for(smollm_tokenizer)
    assert isinstance(recipe, ChatMLRecipe)
    recipe.tool_format = ToolFormat.from_template(QWEN25_TOOLS)
    recipe.default_system_prompt = QWEN_SYSTEM
    return recipe


def test_format_read_from_template() -> None:
    fmt = ToolFormat.from_template(QWEN25_TOOLS)
    assert (fmt.head, fmt.tail, fmt.response_role) == (DEFAULT_HEAD, DEFAULT_TAIL, "user")
    assert ToolFormat.from_template("{{ '<|im_start|>' + m.role }}") == ToolFormat()


@pytest.mark.slow
def test_equals_qwen25_tool_template(smollm_tokenizer: Tokenizer, qwen_style: ChatMLRecipe) -> None:
    rng = random.Random(0)
    for _ in range(60):
        ours, theirs = conversation(rng)
        expected = render(smollm_tokenizer, QWEN25_TOOLS, theirs, TOOLS)
        assert qwen_style.encode(ours, tools=specs()) == expected, theirs
    user = [ChatMessage("user", "hi")]
    expected = render(smollm_tokenizer, QWEN25_TOOLS, [{"role": "user", "content": "hi"}], TOOLS)
    assert qwen_style.encode(user, tools=specs()) == expected


@pytest.mark.slow
def test_default_format_on_smollm2(smollm_tokenizer: Tokenizer) -> None:
    """SmolLM2's template has no tool section: the default is the same layout, its default
    system prompt, and results in `tool` turns."""
    recipe = recipe_for(smollm_tokenizer)
    assert isinstance(recipe, ChatMLRecipe) and recipe.tool_format.response_role == "tool"
    assert recipe.default_system_prompt is not None
    template = QWEN25_TOOLS.replace(QWEN_SYSTEM, recipe.default_system_prompt).replace(
        "'<|im_start|>user' }}", "'<|im_start|>tool' }}"
    )
    rng = random.Random(1)
    for _ in range(30):
        ours, theirs = conversation(rng)
        expected = render(smollm_tokenizer, template, theirs, TOOLS)
        assert recipe.encode(ours, tools=specs()) == expected, theirs
