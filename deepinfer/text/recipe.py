"""The chat encoder: messages -> token ids, with no way for text to become a control token.

The recipe never renders a conversation to one string. It emits structural markers (`<|im_start|>`,
`<|im_end|>`) as ids and encodes every stretch of text between two markers with the content
tokenizer, which spells control-token text as plain pieces. On ordinary text the ids equal the
model's Jinja template rendered and tokenized; on text that spells a control token they differ, on
purpose (that is the injection this module prevents).

Rendering rules (ChatML):
- Each message is `<|im_start|>` + encode(f"{role}\\n{body}") + `<|im_end|>` + encode("\\n"),
  where the role header and body share one encode call, as render-then-tokenize would.
- `name` is written plainly at the start of the body: `f"{name}: {content}"`. ChatML has no name
  field and the shipped templates drop it; a prefix keeps it visible to the model.
- Roles: system, user, assistant, tool (`tool` is a ChatML turn of its own, as SmolLM2's template
  renders any role). Anything else raises `InvalidRequestError(param="messages[i].role")`.
- Default system prompt: when the template inserts one (a string literal
  `<|im_start|>system\\n...<|im_end|>` in the template) and the first message is not a system
  message, it is inserted the same way.
- Reasoning effort: the line `Reasoning effort: {effort}.` is appended to the system prompt (the
  given one, else the default one) after a blank line (`"\\n\\n"`); with neither, it is the whole
  system prompt.
- Tools: a conversation with tool definitions, calls or results is rendered in the model's tool
  format (`tools.py`, read from the template once): the same turns, with the markers it writes
  as ids where the vocabulary has them, and no text able to spell one.
- Prefill (`continue_final_message`): the conversation ends with an assistant turn that is left
  open, its end marker (and what follows it) not written, so the answer continues its text; no
  generation prompt follows. This is what transformers' `apply_chat_template(...,
  continue_final_message=True)` renders: the template's text up to the end of the final content
  (trimmed where the template trims it).
- Thinking (`enable_thinking`): read by the families whose template has the switch
  (`recipe_reasoning.py`); the others ignore it, as their templates do.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import ClassVar, Literal

from deepinfer.errors import InvalidRequestError, ModelLoadError
from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tools import MARKERS, Piece, ToolFormat, join_pieces, uses_tools

__all__ = ["ChatMessage", "ChatRecipe", "ToolCall", "ToolSpec"]

ReasoningEffort = Literal["low", "medium", "high"]
ROLES = ("system", "user", "assistant", "tool")
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.+?)<\|im_end\|>", re.DOTALL)


def reasoning_effort_line(effort: ReasoningEffort) -> str:
    """The exact line added to the system prompt for a reasoning effort."""
    return f"Reasoning effort: {effort}."


def find_default_system_prompt(template: str) -> str | None:
    """The system prompt a ChatML template inserts on its own, read from its string literals."""
    for match in _STRING_LITERAL.finditer(template):
        try:
            # Jinja literals may hold raw newlines, which Python literals may not.
            literal = ast.literal_eval(match.group(0).replace("\n", "\\n"))
        except (SyntaxError, ValueError):
            continue
        found = _DEFAULT_SYSTEM.search(literal) if isinstance(literal, str) else None
        if found:
            return found.group(1)
    return None


class ChatRecipe:
    """Encodes chat messages for one model. `recipe_families.recipe_for` picks the format."""

    end_of_turn_ids: frozenset[int]
    """Ids that end an assistant turn (generation stops on them)."""
    turn_stops: tuple[str, ...] = ()
    """Text that begins another turn where no token ends one (a transcript's `\nUser:`): a
    chat answer stops there (`SamplingParams.with_turn_stops`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids = frozenset([] if eos is None else [eos])

    def encode(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        reasoning_effort: ReasoningEffort | None = None,
        tools: Sequence[ToolSpec] = (),
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """Prompt ids for `messages` (and the tools the model may call), ending with the
        assistant header when asked, or inside the final assistant turn when continuing it."""
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a raw completion prompt: BOS when the model wants it, then the text as content
        (control-token text stays plain)."""
        return self._bos() + self.tokenizer.encode(text)

    def _bos(self) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return [bos] if self.tokenizer.add_bos and bos is not None else []

    @staticmethod
    def _validated(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role is {m.role!r}; expected one of {', '.join(ROLES)}",
                    param=f"messages[{i}].role",
                )
        return list(messages)

    @staticmethod
    def _check_prefill(messages: Sequence[ChatMessage]) -> None:
        """A conversation to continue ends with an assistant turn that calls no tools."""
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or last.tool_calls:
            raise InvalidRequestError(
                "messages: continue_final_message needs the last message to be an assistant "
                "message with text (no tool calls) to continue",
                param="messages",
            )

    def _without_tools(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], why: str
    ) -> tuple[str | None, list[ChatMessage]]:
        """For a format with no tool format of its own: the system prompt and the other turns
        of a conversation that uses no tools (else `InvalidRequestError` saying `why`)."""
        turns = self._validated(messages)
        if uses_tools(turns, tools):
            raise InvalidRequestError(f"tools: {why}", param="tools")
        system = self._body(turns.pop(0)) if turns and turns[0].role == "system" else None
        return system, turns

    @staticmethod
    def _body(message: ChatMessage) -> str:
        return message.content if message.name is None else f"{message.name}: {message.content}"

    @staticmethod
    def _with_effort(system: str | None, effort: ReasoningEffort | None) -> str | None:
        if effort is None:
            return system
        if effort not in ("low", "medium", "high"):
            raise InvalidRequestError(
                f"reasoning_effort is {effort!r}; expected low, medium or high",
                param="reasoning_effort",
            )
        line = reasoning_effort_line(effort)
        return line if system is None else f"{system}\n\n{line}"


class ChatMLRecipe(ChatRecipe):
    """`<|im_start|>role\\ncontent<|im_end|>\\n` turns (SmolLM2, Qwen2/2.5)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        start, end = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
        if start is None or end is None or not {start, end} <= tokenizer.special_token_ids:
            raise ModelLoadError(
                "ChatML template, but <|im_start|>/<|im_end|> are not control tokens"
            )
        self.im_start_id, self.im_end_id = start, end
        self.newline_ids = tokenizer.encode("\n")
        self.default_system_prompt = find_default_system_prompt(tokenizer.chat_template or "")
        stops = {end, *self.end_of_turn_ids, tokenizer.token_to_id("<|endoftext|>")}
        self.end_of_turn_ids = frozenset(i for i in stops if i is not None)
        marker_ids = {m: tokenizer.token_to_id(m) for m in MARKERS}
        self.tool_format = ToolFormat.from_template(tokenizer.chat_template).with_marker_ids(
            {
                m: i
                for m, i in marker_ids.items()
                if i is not None and i in tokenizer.added_token_ids
            }
        )

    def encode(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        reasoning_effort: ReasoningEffort | None = None,
        tools: Sequence[ToolSpec] = (),
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        turns = self._validated(messages)
        if continue_final_message:
            self._check_prefill(turns)
        system: str | None = None
        if turns and turns[0].role == "system":
            system = self._body(turns.pop(0))
        elif turns or tools:  # the templates insert their default only ahead of a first message
            system = self.default_system_prompt
        system = self._with_effort(system, reasoning_effort)
        rendered: list[list[Piece]]
        if uses_tools(turns, tools):
            rendered = self.tool_format.render(system, turns, tools)
        else:  # the plain path, unchanged by the tool format
            rendered = [] if system is None else [[f"system\n{system}"]]
            rendered += [[f"{m.role}\n{self._body(m)}"] for m in turns]
        ids = self._bos()
        for encoded in self._encode_turns(rendered):
            ids += [self.im_start_id, *encoded, self.im_end_id, *self.newline_ids]
        if continue_final_message:  # the last turn stays open
            del ids[-1 - len(self.newline_ids) :]
        elif add_generation_prompt:
            ids += [self.im_start_id, *self.tokenizer.encode("assistant\n")]
        return ids

    def _encode_turns(self, turns: Sequence[Sequence[Piece]]) -> list[list[int]]:
        """Each turn's ids: its texts encoded in one batch, its marker ids kept as they are."""
        joined = [join_pieces(t) for t in turns]
        texts = [p for t in joined for p in t if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_batch(texts))
        return [
            [i for p in t for i in (next(encoded) if isinstance(p, str) else [p])] for t in joined
        ]


class PlainRecipe(ChatRecipe):
    """No template (base models): `System: ...\\n\\nUser: ...\\n\\nAssistant:` as plain text.

    There are no control tokens to protect; everything is content. A base model has no
    end-of-turn token for chat and goes on writing the transcript, so a chat answer stops at the
    next turn's label on a line of its own (`turn_stops`)."""

    turn_stops = tuple(
        f"{sep}{label}:" for label in ("User", "System", "Assistant") for sep in ("\n\n", "\n")
    )
    """The blank line before a label goes with it (among stops ending together, the longest
    wins), so the answer ends with its own text."""

    _LABELS: ClassVar[dict[str, str]] = {
        "system": "System",
        "user": "User",
        "assistant": "Assistant",
        "tool": "Tool",
    }

    def encode(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        reasoning_effort: ReasoningEffort | None = None,
        tools: Sequence[ToolSpec] = (),
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        system, turns = self._without_tools(
            messages, tools, "this model has no chat template, so no tool format"
        )
        if continue_final_message:
            self._check_prefill(turns)
        system = self._with_effort(system, reasoning_effort)
        parts = [] if system is None else [f"System: {system}"]
        parts += [f"{self._LABELS[m.role]}: {self._body(m)}" for m in turns]
        if add_generation_prompt and not continue_final_message:
            parts.append("Assistant:")
        return self._bos() + self.tokenizer.encode("\n\n".join(parts))
