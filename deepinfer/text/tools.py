"""The tool format beside the chat recipe: Hermes-style calls, as Qwen2.5's template writes them.

Rendering (ChatML turns; `<turn>` stands for `<|im_start|>...<|im_end|>\\n` as in `recipe.py`):
- Tools, in the system turn: `{system}` + head + one `\\n{definition JSON}` per tool + tail, where
  head ends with `<tools>` and tail starts with `\\n</tools>` and explains the call syntax. The
  system text is the given system prompt, else the template's default one; with neither, the head
  loses its leading newlines.
- An assistant turn with calls: `assistant` + (`\\n{content}` when there is content) + per call
  `\\n<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`.
- Consecutive tool results: one turn of `response_role` (`user` in Qwen2.5's template, `tool` by
  default) holding `\\n<tool_response>\\n{content}\\n</tool_response>` per result.

The head, tail and response role are read from the model's template when it has a tool section
(string literals holding `<tools>` / `</tools>`, a `'<|im_start|>user'` opening tool results);
otherwise the documented defaults below (Qwen2.5's own wording) apply. Qwen3's template writes
the same turns as Qwen2.5's, without a default system prompt; the `<think>` block it writes in
an assistant turn after the last user message is the reasoning format's, not the tool format's.

Injection: markers the recipe writes are ids when the vocabulary has them as added tokens, else
text. Text from a request (contents, names, tool results, arguments, definitions) never spells a
marker: `<` of `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `<tools>`,
`</tools>` becomes `&lt;` in free text and `\\u003c` inside JSON (the same JSON value). So a
result cannot close its response early and nothing a client wrote parses back as a call.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from deepinfer.text.messages import ChatMessage, ToolSpec
from deepinfer.text.tool_markup import CallMarkup, Piece

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_OPEN, TOOLS_CLOSE = "<tools>", "</tools>"
MARKERS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN, TOOLS_CLOSE)

DEFAULT_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
DEFAULT_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

CALL_TAIL = "}\n"
"""A call's text between its arguments and `</tool_call>`."""
CALL_SEPARATOR = "\n"
"""Written before each `<tool_call>` after an assistant turn's header, and between calls."""

_MARKER_LT = re.compile(r"<(?=/?(?:tool_call|tool_response|tools)>)")
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TURN_END = "<|im_end|>\n"


def neutralize_text(text: str) -> str:
    """Free text with every marker's `<` written `&lt;`."""
    return _MARKER_LT.sub("&lt;", text)


def neutralize_json(text: str) -> str:
    """JSON text with every marker's `<` written `\\u003c` (only strings can hold `<`)."""
    return _MARKER_LT.sub(r"\\u003c", text)


def _literals(template: str) -> list[str]:
    out: list[str] = []
    for match in _STRING_LITERAL.finditer(template):
        try:
            literal = ast.literal_eval(match.group(0).replace("\n", "\\n"))
        except (SyntaxError, ValueError):
            continue
        if isinstance(literal, str):
            out.append(literal)
    return out


@dataclass(frozen=True)
class ToolFormat:
    """How one model's template writes tools, calls and results (Hermes-style)."""

    head: str = DEFAULT_HEAD
    tail: str = DEFAULT_TAIL
    response_role: str = "tool"
    marker_ids: Mapping[str, int] = field(default_factory=dict)
    """Markers the vocabulary holds as added tokens: emitted as these ids, never as text."""

    @staticmethod
    def from_template(template: str | None) -> ToolFormat:
        """The format of a template's tool section, or the defaults when it has none."""
        literals = _literals(template or "")
        heads = [s for s in literals if s.endswith(TOOLS_OPEN)]
        tails = [
            s for s in literals if s.startswith(TOOLS_CLOSE) or s.startswith("\n" + TOOLS_CLOSE)
        ]
        if not heads or not tails:
            return ToolFormat()
        tail = tails[0].removesuffix(_TURN_END).removesuffix("<|im_end|>")
        user_results = "<|im_start|>user" in literals and RESPONSE_OPEN in (template or "")
        # Qwen3 writes the blank line after the system prompt apart from the head ("\n\n" +
        # "# Tools..."), Qwen2.5 as the head's start: the same text either way.
        head = heads[0] if heads[0].startswith("\n") else "\n\n" + heads[0]
        return ToolFormat(head, tail, "user" if user_results else "tool")

    def with_marker_ids(self, marker_ids: Mapping[str, int]) -> ToolFormat:
        return replace(self, marker_ids=dict(marker_ids))

    @property
    def markup(self) -> CallMarkup:
        """Calls in an answer: `<tool_call>` blocks (the markers as ids where known)."""
        open_, close = (self.marker_ids.get(m, m) for m in (CALL_OPEN, CALL_CLOSE))
        return CallMarkup(
            head=call_head,
            call_open=(open_,),
            call_close=(CALL_TAIL, close),
            separator=CALL_SEPARATOR,
            opener=CALL_OPEN,
            closer=CALL_CLOSE,
        )

    def render(
        self, system: str | None, turns: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> list[list[Piece]]:
        """Each turn's pieces, role header first; `system` is already the final system text."""
        out: list[list[Piece]] = []
        if tools:
            out.append(self._system(system, tools))
        elif system is not None:
            out.append([f"system\n{neutralize_text(system)}"])
        k = 0
        while k < len(turns):
            m = turns[k]
            if m.role == "tool":
                run = [m]
                while k + len(run) < len(turns) and turns[k + len(run)].role == "tool":
                    run.append(turns[k + len(run)])
                out.append(self._results(run))
                k += len(run)
                continue
            out.append(self._turn(m))
            k += 1
        return out

    def _pieces(self, text: str) -> list[Piece]:
        """Trusted text (the template's, or already neutralised) with markers as ids if known."""
        if not self.marker_ids:
            return [text]
        pattern = "(" + "|".join(re.escape(m) for m in self.marker_ids) + ")"
        return [self.marker_ids.get(p, p) for p in re.split(pattern, text) if p]

    def _system(self, system: str | None, tools: Sequence[ToolSpec]) -> list[Piece]:
        head = self.head if system is not None else self.head.lstrip("\n")
        prefix = "system\n" + ("" if system is None else neutralize_text(system))
        defs = "".join("\n" + neutralize_json(t.definition) for t in tools)
        return [prefix, *self._pieces(head), defs, *self._pieces(self.tail)]

    def _turn(self, m: ChatMessage) -> list[Piece]:
        body = m.content if m.name is None else f"{m.name}: {m.content}"
        if not m.tool_calls:
            return [f"{m.role}\n{neutralize_text(body)}"]
        pieces: list[Piece] = [m.role + (f"\n{neutralize_text(body)}" if body else "")]
        for call in m.tool_calls:
            body = call_head(call.name) + neutralize_json(call.arguments) + CALL_TAIL
            pieces += [CALL_SEPARATOR, *self._pieces(CALL_OPEN), body, *self._pieces(CALL_CLOSE)]
        return pieces

    def _results(self, run: Sequence[ChatMessage]) -> list[Piece]:
        pieces: list[Piece] = [self.response_role]
        for m in run:
            pieces += ["\n", *self._pieces(RESPONSE_OPEN)]
            pieces += [f"\n{neutralize_text(m.content)}\n", *self._pieces(RESPONSE_CLOSE)]
        return pieces


def call_head(name: str) -> str:
    """A call's text between `<tool_call>` and its arguments (the name JSON-escaped, no marker
    spelled). With `CALL_TAIL` and `CALL_SEPARATOR`, the one definition of a call's text: the
    renderer writes it, the parser reads it back, the forced-call grammar spells it."""
    name_json = neutralize_json(json.dumps(name, ensure_ascii=False)[1:-1])
    return f'\n{{"name": "{name_json}", "arguments": '


def uses_tools(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> bool:
    """Whether a conversation is rendered in the tool format."""
    return bool(tools) or any(m.tool_calls or m.tool_call_id is not None for m in messages)


def join_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent texts merged, so each stretch between markers is encoded in one call (as a
    rendered template would be tokenized)."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return out


HERMES_MARKUP = ToolFormat().markup
"""Hermes calls with text markers: the parser's default."""
