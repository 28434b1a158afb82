"""An answer cut by the token limit inside tool-call markup, in every API, streamed or not,
through the official SDKs over the fake engine (a scripted answer, one character a token): the
complete calls come back as calls, a call cut in its arguments as a truncated call, and no
markup as text; the finish is the token limit's (`length`, `max_tokens`, `incomplete`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from tests.api.fake_engine import FakeEngine

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
]
ANTHROPIC_TOOLS: Any = [{"name": "get_weather", "input_schema": PARAMETERS}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
USER: Any = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


def call(args: dict[str, Any]) -> str:
    body = json.dumps({"name": "get_weather", "arguments": args})
    return f"<tool_call>\n{body}\n</tool_call>"


PARIS, OSLO = call({"city": "Paris"}), call({"city": "Oslo"})
TWO = PARIS + "\n" + OSLO
CUTS = {
    # name: (answer, tokens it is cut at, the calls that come back, the last one truncated)
    "in the next call's header": (TWO, len(PARIS) + len('\n<tool_call>\n{"name":'), 1, False),
    "in the next call's marker": (TWO, len(PARIS) + len("\n<tool_"), 1, False),
    "in the closing marker": (TWO, len(PARIS) - len("call>"), 1, False),
    "in the arguments": (TWO, len(PARIS) + 1 + OSLO.index("Os") + 2, 2, True),
}
CHOICES = ("auto", "required", "named")


@dataclass
class Answer:
    """What a client reads back, the same for every API."""

    text: str
    calls: list[tuple[str, str]]
    """Each call's name and arguments (JSON text)."""
    finish: str
    call_statuses: list[str | None]


def chat(oai: openai.OpenAI, choice: str, max_tokens: int, stream: bool) -> Answer:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: Any = {
        "model": "m", "messages": USER, "tools": OPENAI_TOOLS, "max_tokens": max_tokens,
        "tool_choice": named if choice == "named" else choice,
    }  # fmt: skip
    if not stream:
        c = oai.chat.completions.create(**kwargs).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]  # type: ignore[union-attr]
        return Answer(c.message.content or "", calls, c.finish_reason, [])
    text, heads, args, finish = "", [], [], ""
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for t in delta.tool_calls or []:
            assert t.function is not None
            if t.function.name is not None:
                heads.append(t.function.name)
                args.append("")
            args[t.index] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return Answer(text, list(zip(heads, args, strict=True)), finish, [])


def messages(claude: anthropic.Anthropic, choice: str, max_tokens: int, stream: bool) -> Answer:
    kinds = {"auto": {"type": "auto"}, "required": {"type": "any"}}
    kwargs: Any = {
        "model": "m", "messages": USER, "tools": ANTHROPIC_TOOLS, "max_tokens": max_tokens,
        "tool_choice": kinds.get(choice, {"type": "tool", "name": "get_weather"}),
    }  # fmt: skip
    if stream:
        with claude.messages.stream(**kwargs) as events:
            m = events.get_final_message()
    else:
        m = claude.messages.create(**kwargs)
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
    return Answer(text, calls, m.stop_reason or "", [])


def responses(oai: openai.OpenAI, choice: str, max_tokens: int, stream: bool) -> Answer:
    kwargs: Any = {
        "model": "m", "input": USER, "tools": RESPONSES_TOOLS, "max_output_tokens": max_tokens,
        "tool_choice": {"type": "function", "name": "get_weather"} if choice == "named" else choice,
    }  # fmt: skip
    if stream:
        events = list(oai.responses.create(**kwargs, stream=True))
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = oai.responses.create(**kwargs)
    assert r.incomplete_details is not None
    finish = f"{r.status}: {r.incomplete_details.reason}"
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    statuses = [i.status for i in r.output if i.type == "function_call"]
    return Answer(r.output_text, calls, finish, statuses)


Ask = Callable[[Any, str, int, bool], Answer]
APIS: dict[str, tuple[Ask, str, str]] = {
    "chat": (chat, "oai", "length"),
    "messages": (messages, "claude", "max_tokens"),
    "responses": (responses, "oai", "incomplete: max_output_tokens"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("cut", CUTS)
def test_a_cut_call_is_never_text(
    request: pytest.FixtureRequest, reply: FakeEngine, api: str, cut: str, stream: bool
) -> None:
    ask, client, finish = APIS[api]
    text, max_tokens, num_calls, truncated = CUTS[cut]
    reply.reply = text
    for choice in CHOICES:
        answer = ask(request.getfixturevalue(client), choice, max_tokens, stream)
        expected = min(num_calls, 1) if choice == "named" else num_calls
        assert answer.text == "" and answer.finish == finish, (choice, answer)
        assert [name for name, _ in answer.calls] == ["get_weather"] * expected
        assert json.loads(answer.calls[0][1]) == {"city": "Paris"}
        if expected == 2 and truncated:  # the cut arguments, as far as they got
            assert answer.calls[1][1] in ('{"city": "Os', "{}"), answer  # Anthropic: {}
        if api == "responses":
            cut_last = truncated and expected == 2
            assert answer.call_statuses[-1] == ("incomplete" if cut_last else "completed")
            assert set(answer.call_statuses[:-1]) <= {"completed"}
