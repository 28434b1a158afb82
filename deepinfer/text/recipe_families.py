"""Chat formats beyond ChatML, encoded by construction: Llama 3, Gemma, Mistral.

As in `recipe.py`, a conversation is never rendered to one string: each format's markers are
emitted as ids and every stretch of text between two markers is encoded as content, so text that
spells a control token stays plain. On ordinary text the ids equal the family's official Jinja
template rendered and tokenized (`tests/text/test_recipe_families.py` holds those templates).
Every family puts BOS first (its templates write `bos_token`). Rules:

- Llama 3: `<|start_header_id|>` role `<|end_header_id|>` "\\n\\n" + content.strip() `<|eot_id|>`
  for every message, in order, roles written as given; Llama 3.1's templates (those that write a
  "Cutting Knowledge Date") always open with a system turn, "Cutting Knowledge Date: December
  2023\\nToday Date: 26 Jul 2024\\n\\n" before the system prompt (the date the template uses when
  none is passed). Generation: `<|start_header_id|>` "assistant" `<|end_header_id|>` "\\n\\n".
  Ends on `<|eot_id|>`, `<|eom_id|>`, `<|end_of_text|>`.
- Gemma: `<start_of_turn>` + "user\\n" or "model\\n" + content.strip() + `<end_of_turn>` "\\n";
  the system prompt and a blank line open the first user turn (Gemma 3's templates; Gemma 2's
  refuse system messages, so this only adds to what they take; a system message alone opens a
  user turn of its own, where the template would drop it). Generation:
  `<start_of_turn>` "model\\n". Ends on `<end_of_turn>` and EOS.
- Mistral (v0.3's template): a user turn is `[INST]` " " + content + `[/INST]`, the system prompt
  and a blank line opening it when it is the last message (earlier turns, or a conversation
  that ends with the assistant, never show it); an assistant turn is " " + content.strip() + EOS.
  The generation prompt is the last `[INST]` turn itself. `[INST]` and `[/INST]` must be control
  tokens (in older vocabularies they are plain text, and a typed one could not be told apart).
- Prefill (`continue_final_message`): the final assistant turn as above without what closes it
  (`<|eot_id|>`; `<end_of_turn>` "\\n"; EOS), its content trimmed as the templates trim it.

Gemma and Mistral take user and assistant turns alternating, starting with the user (their
templates raise otherwise): anything else is an `InvalidRequestError` naming the message.

Tools (definitions, calls, results, `tool` messages) are written in the family's own format
where its template has one: Llama 3.1+ (`tools_llama3.py`: templates with an `ipython` role) and
Mistral v3 (`tools_mistral.py`: templates writing `[TOOL_CALLS]`, its five tool markers control
tokens; tool results and assistant turns with calls stand outside the user/assistant
alternation). Elsewhere (Gemma, whose templates have no tool tokens, Llama 3, older Mistral
templates) they are refused with an `InvalidRequestError` naming the family.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.errors import InvalidRequestError, ModelLoadError
from deepinfer.text.messages import ChatMessage, ToolSpec
from deepinfer.text.recipe import (
    IM_END,
    IM_START,
    ChatMLRecipe,
    ChatRecipe,
    PlainRecipe,
    ReasoningEffort,
)
from deepinfer.text.recipe_reasoning import (
    DeepSeekR1Recipe,
    Qwen3Recipe,
    is_qwen3_template,
    is_r1_template,
)
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tool_markup import FamilyTools
from deepinfer.text.tools import Piece, join_pieces, uses_tools
from deepinfer.text.tools_llama3 import ENVIRONMENT, Llama3Tools
from deepinfer.text.tools_mistral import TOOL_TOKENS, MistralTools

LLAMA3_KNOWLEDGE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def _control_ids(tokenizer: Tokenizer, family: str, names: Sequence[str]) -> list[int]:
    """The ids of a format's markers, each a control token of the vocabulary."""
    ids = [tokenizer.token_to_id(n) for n in names]
    if any(i is None or i not in tokenizer.special_token_ids for i in ids):
        raise ModelLoadError(
            f"{family} chat template, but {', '.join(names)} are not all control tokens"
        )
    return [i for i in ids if i is not None]


def recipe_for(tokenizer: Tokenizer) -> ChatRecipe:
    """The recipe for the tokenizer's chat template, its family read from the markers the
    template writes: Qwen3 and DeepSeek-R1-distill (`recipe_reasoning.py`), ChatML
    (`recipe.py`), Llama 3, Gemma, Mistral, or plain text when there is no template. Other templates raise `ModelLoadError` rather than being guessed at."""
    template = tokenizer.chat_template
    if template is None or not template.strip():
        return PlainRecipe(tokenizer)
    if is_qwen3_template(template):
        return Qwen3Recipe(tokenizer)
    if is_r1_template(template):
        return DeepSeekR1Recipe(tokenizer)
    if IM_START in template and IM_END in template:
        return ChatMLRecipe(tokenizer)
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return Llama3Recipe(tokenizer)
    if "<start_of_turn>" in template:
        return GemmaRecipe(tokenizer)
    if "[INST]" in template:
        return MistralRecipe(tokenizer)
    raise ModelLoadError(
        "unsupported chat template: deepinfer's injection-safe encoder knows ChatML "
        "(<|im_start|>/<|im_end|>, e.g. SmolLM2, Qwen2; Qwen3 with think blocks), "
        "DeepSeek-R1-distill (<｜User｜>/<｜Assistant｜>), Llama 3 (<|start_header_id|>), "
        "Gemma (<start_of_turn>), Mistral ([INST]) and models without a template"
    )


class FamilyRecipe(ChatRecipe):
    """A format whose markers are all control tokens and whose prompt starts with BOS."""

    family = ""
    num_turn_end_pieces = 1
    """Pieces that close a turn (its end marker and what follows it): left off the final turn
    when it is continued."""
    tool_format: FamilyTools | None = None
    """The family's tool format, where its template has one (None: tools are refused)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        if tokenizer.bos_token_id is None:
            raise ModelLoadError(f"{self.family} chat template, but the vocabulary has no BOS")
        self.bos_id = tokenizer.bos_token_id

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
        offset = int(bool(turns) and turns[0].role == "system")
        system = self._body(turns.pop(0)) if offset else None
        system = self._with_effort(system, reasoning_effort)
        if continue_final_message:
            self._check_prefill(turns)
        if uses_tools(turns, tools) or any(m.role == "tool" for m in turns):
            self._check_tools(turns, tools, offset)
            pieces = self.tool_pieces(system, turns, tools, offset)
        else:
            pieces = self.pieces(system, turns)
        if continue_final_message:  # the last turn stays open
            del pieces[len(pieces) - self.num_turn_end_pieces :]
        elif add_generation_prompt:
            pieces += self.generation_prompt()
        return self._encode_pieces([self.bos_id, *pieces])

    def _check_tools(
        self, turns: Sequence[ChatMessage], tools: Sequence[ToolSpec], offset: int
    ) -> None:
        """Refuses a conversation with tools where the family has no tool format."""
        if self.tool_format is not None:
            return
        why = (
            f"this model's {self.family} chat template has no tool format; deepinfer writes "
            "tool calls for ChatML (Hermes <tool_call>, e.g. Qwen2.5, Qwen3), Llama 3.1+ and "
            "Mistral v3 ([TOOL_CALLS]) templates"
        )
        if uses_tools(turns, tools):
            raise InvalidRequestError(f"tools: {why}", param="tools")
        i = offset + next(k for k, m in enumerate(turns) if m.role == "tool")
        raise InvalidRequestError(
            f"messages[{i}].role is 'tool': {why}", param=f"messages[{i}].role"
        )

    def tool_pieces(
        self,
        system: str | None,
        turns: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        offset: int,
    ) -> list[Piece]:
        """`pieces` of a conversation with tools (`offset`: messages before `turns`)."""
        raise NotImplementedError

    def pieces(self, system: str | None, turns: Sequence[ChatMessage]) -> list[Piece]:
        raise NotImplementedError

    def generation_prompt(self) -> list[Piece]:
        return []

    def _encode_pieces(self, pieces: Sequence[Piece]) -> list[int]:
        """Marker ids as they are; each stretch of text between two encoded in one call."""
        joined = join_pieces(pieces)
        texts = [p for p in joined if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_batch(texts))
        return [i for p in joined for i in (next(encoded) if isinstance(p, str) else [p])]

    def _alternating(self, turns: Sequence[ChatMessage], offset: int) -> None:
        """User and assistant turns in turn, the user first (`offset`: messages before them)."""
        self._alternating_at(list(enumerate(turns, offset)))

    def _alternating_at(self, turns: Sequence[tuple[int, ChatMessage]]) -> None:
        """`_alternating` for turns given with their indices in the request."""
        for k, (i, m) in enumerate(turns):
            expected = "user" if k % 2 == 0 else "assistant"
            if m.role != expected:
                raise InvalidRequestError(
                    f"messages[{i}].role is {m.role!r}; this model's {self.family} "
                    f"format takes an optional system message, then user and assistant messages "
                    f"in turn, starting with the user ({expected!r} expected here)",
                    param=f"messages[{i}].role",
                )


class Llama3Recipe(FamilyRecipe):
    family = "Llama 3"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        names = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        self.header_id, self.header_end_id, self.eot_id = _control_ids(
            tokenizer, self.family, names
        )
        self.dated = "Cutting Knowledge Date" in (tokenizer.chat_template or "")
        """Llama 3.1's templates: a system turn always, with the knowledge and today's date."""
        more = (tokenizer.token_to_id(t) for t in ("<|eom_id|>", "<|end_of_text|>"))
        ends = {self.eot_id, *self.end_of_turn_ids, *(i for i in more if i is not None)}
        self.end_of_turn_ids = frozenset(ends)
        if self.dated and "ipython" in (tokenizer.chat_template or ""):
            tag = tokenizer.token_to_id("<|python_tag|>")
            self.tool_format = Llama3Tools(tag if tag in tokenizer.special_token_ids else None)

    def _turn(self, role: str, text: str) -> list[Piece]:
        return [self.header_id, role, self.header_end_id, "\n\n" + text, self.eot_id]

    def pieces(self, system: str | None, turns: Sequence[ChatMessage]) -> list[Piece]:
        out: list[Piece] = []
        if self.dated:
            out += self._turn("system", LLAMA3_KNOWLEDGE + (system or "").strip())
        elif system is not None:
            out += self._turn("system", system.strip())
        for m in turns:
            out += self._turn(m.role, self._body(m).strip())
        return out

    def generation_prompt(self) -> list[Piece]:
        return [self.header_id, "assistant", self.header_end_id, "\n\n"]

    def tool_pieces(
        self,
        system: str | None,
        turns: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        offset: int,
    ) -> list[Piece]:
        assert isinstance(self.tool_format, Llama3Tools)
        fmt = self.tool_format
        head = ENVIRONMENT if tools else ""
        out = self._turn("system", head + LLAMA3_KNOWLEDGE + (system or "").strip())
        rest = list(enumerate(turns, offset))
        if tools:
            if not turns or turns[0].role != "user":
                raise InvalidRequestError(
                    f"messages[{offset}]: this model's {self.family} format lists the tools in "
                    "the first user message, so one must follow the system message",
                    param=f"messages[{offset}]",
                )
            out += self._turn("user", fmt.first_user_text(self._body(turns[0]), tools))
            rest = rest[1:]
        for i, m in rest:
            if m.tool_calls:
                if len(m.tool_calls) != 1:
                    raise InvalidRequestError(
                        f"messages[{i}].tool_calls: this model's {self.family} format holds one "
                        f"call per assistant message; got {len(m.tool_calls)}",
                        param=f"messages[{i}].tool_calls",
                    )
                out += self._turn("assistant", fmt.call_text(m.tool_calls[0]))
            elif m.role == "tool":
                out += self._turn("ipython", fmt.result_text(m.content))
            else:
                out += self._turn(m.role, self._body(m).strip())
        return out


class GemmaRecipe(FamilyRecipe):
    family = "Gemma"
    num_turn_end_pieces = 2

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        names = ("<start_of_turn>", "<end_of_turn>")
        self.start_id, self.end_id = _control_ids(tokenizer, self.family, names)
        self.end_of_turn_ids = frozenset({self.end_id, *self.end_of_turn_ids})

    def pieces(self, system: str | None, turns: Sequence[ChatMessage]) -> list[Piece]:
        self._alternating(turns, offset=int(system is not None))
        out: list[Piece] = []
        for k, m in enumerate(turns):
            role = "model" if m.role == "assistant" else "user"
            prefix = f"{system}\n\n" if k == 0 and system is not None else ""
            out += [self.start_id, f"{role}\n{prefix}{self._body(m).strip()}", self.end_id, "\n"]
        if not turns and system is not None:  # a system prompt alone still opens a user turn
            out += [self.start_id, f"user\n{system}\n\n", self.end_id, "\n"]
        return out

    def generation_prompt(self) -> list[Piece]:
        return [self.start_id, "model\n"]


class MistralRecipe(FamilyRecipe):
    family = "Mistral"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.inst_id, self.inst_end_id = _control_ids(tokenizer, self.family, ("[INST]", "[/INST]"))
        if tokenizer.eos_token_id is None:
            raise ModelLoadError("Mistral chat template, but the vocabulary has no EOS")
        self.eos_id = tokenizer.eos_token_id
        tool_ids = [tokenizer.token_to_id(t) for t in TOOL_TOKENS]
        if "[TOOL_CALLS]" in (tokenizer.chat_template or "") and all(
            i is not None and i in tokenizer.special_token_ids for i in tool_ids
        ):
            self.tool_format = MistralTools([i for i in tool_ids if i is not None])

    def pieces(self, system: str | None, turns: Sequence[ChatMessage]) -> list[Piece]:
        self._alternating(turns, offset=int(system is not None))
        out: list[Piece] = []
        for k, m in enumerate(turns):
            if m.role == "user":
                last = k == len(turns) - 1
                prefix = f"{system}\n\n" if last and system is not None else ""
                out += [self.inst_id, f" {prefix}{self._body(m)}", self.inst_end_id]
            else:
                out += [f" {self._body(m).strip()}", self.eos_id]
        return out

    def tool_pieces(
        self,
        system: str | None,
        turns: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        offset: int,
    ) -> list[Piece]:
        assert isinstance(self.tool_format, MistralTools)
        fmt = self.tool_format
        indexed = list(enumerate(turns, offset))
        self._alternating_at([(i, m) for i, m in indexed if m.role != "tool" and not m.tool_calls])
        users = [k for k, m in enumerate(turns) if m.role == "user"]
        out: list[Piece] = []
        for k, m in enumerate(turns):
            if m.role == "user":
                if tools and k == users[-1]:
                    out += fmt.definitions(tools)
                prefix = f"{system}\n\n" if k == users[-1] and system is not None else ""
                out += [self.inst_id, f" {prefix}{self._body(m)}", self.inst_end_id]
            elif m.tool_calls:
                out += [*fmt.calls(m.tool_calls), self.eos_id]
            elif m.role == "tool":
                out += fmt.result(m)
            else:
                out += [f" {self._body(m).strip()}", self.eos_id]
        return out
