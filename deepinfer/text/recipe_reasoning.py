"""Reasoning models' chat formats: Qwen3 (ChatML with think blocks) and DeepSeek-R1-distill.

Encoded by construction as the other families (`recipe.py`, `recipe_families.py`): markers are
ids, every stretch of client text is content. Think markers (and Qwen3's tool markers) (`<think>`, `</think>`) are added
tokens of these vocabularies that are not control tokens, so text that spells one would match
it: client text is encoded cut before each spelled marker (`reasoning.spelled_markers`), and a
typed `<think>` stays the text `<think>`. On ordinary text the ids equal the published templates
rendered and tokenized (`tests/text/templates/`). Each recipe exposes its `ReasoningFormat`, so
the API can split the answer into reasoning and content by the marker ids the model samples.

- Qwen3: ChatML turns (no default system prompt). An assistant turn before the last user query
  keeps only its content (the text after the last `</think>`, leading newlines dropped); the
  final message, when it is an assistant turn after the last query, is written with its think
  block: `<think>` "\\n" reasoning "\\n" `</think>` "\\n\\n" content (an empty block when it
  has no reasoning). The generation prompt is `<|im_start|>assistant\\n`, followed by an empty
  block `<think>\\n\\n</think>\\n\\n` when `enable_thinking` is false (the model then answers
  without thinking). Tool results (`tool` turns) are written in the tool format, as user turns of
  `<tool_response>` blocks. An assistant turn after the last query that is not the final message
  loses its reasoning (the template would keep it; clients send reasoning back rarely, and
  never as text of the content).
- DeepSeek-R1-distill (its tokenizer.json: `<｜User｜>` and `<｜Assistant｜>` are added
  tokens, not control tokens, so client text is cut inside them too): BOS, then the system prompt as plain text (the last system message: the
  template keeps only that one), then `<｜User｜>` content and `<｜Assistant｜>` content
  `<｜end▁of▁sentence｜>` turns, an assistant's content being its text after the last
  `</think>`. The generation prompt `<｜Assistant｜><think>\\n` opens the think block, so the
  answer starts in its reasoning. No thinking switch (the template has none) and no tool format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from deepinfer.errors import InvalidRequestError, ModelLoadError
from deepinfer.text.messages import ChatMessage, ToolSpec
from deepinfer.text.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningFormat,
    spelled_markers,
    split_think,
)
from deepinfer.text.recipe import ChatMLRecipe, ChatRecipe, ReasoningEffort
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tools import MARKERS, Piece, join_pieces

R1_USER, R1_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def reasoning_format(tokenizer: Tokenizer, family: str, prompt_opens: bool) -> ReasoningFormat:
    """The vocabulary's think markers, each one token (special or not)."""
    open_id, close_id = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
    if open_id is None or close_id is None or not {open_id, close_id} <= tokenizer.added_token_ids:
        raise ModelLoadError(
            f"{family} chat template, but {THINK_OPEN} and {THINK_CLOSE} are not tokens of the "
            "vocabulary"
        )

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=True)

    return ReasoningFormat(open_id, close_id, text(open_id), text(close_id), prompt_opens)


def encode_client_text(
    tokenizer: Tokenizer, text: str, markers: Sequence[str] = (THINK_OPEN, THINK_CLOSE)
) -> list[int]:
    """Content ids of client text, a spelled marker (think, or another added token the format
    writes) kept as text."""
    return [i for piece in spelled_markers(text, markers) for i in tokenizer.encode(piece)]


def is_qwen3_template(template: str) -> bool:
    return "<|im_start|>" in template and THINK_OPEN in template and "enable_thinking" in template


def is_r1_template(template: str) -> bool:
    return R1_USER in template and R1_ASSISTANT in template


class Qwen3Recipe(ChatMLRecipe):
    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.reasoning = reasoning_format(tokenizer, "Qwen3", prompt_opens=False)
        self.markers = tuple(
            m
            for m in (THINK_OPEN, THINK_CLOSE, *MARKERS)
            if tokenizer.token_to_id(m) in tokenizer.added_token_ids
        )
        """Added tokens client text could spell (think and tool markers the vocabulary holds):
        cut inside when encoded, so a typed one stays text on every path. Markers that are not
        tokens (Qwen's `<tools>`) are left whole, as the template's own text spells them."""

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
        last_query = _last_query_index(turns)
        final = turns[-1] if turns and turns[-1].role == "assistant" else None
        if final is not None and len(turns) - 1 <= last_query:
            final = None  # no query before it: written as history is
        head = [_history(m) for m in (turns[:-1] if final is not None else turns)]
        if any(m.role == "tool" and m.tool_call_id is None for m in head):
            head = [replace(m, tool_call_id="") if m.role == "tool" else m for m in head]
        ids = super().encode(
            head,
            add_generation_prompt=add_generation_prompt or final is not None,
            reasoning_effort=reasoning_effort,
            tools=tools,
            continue_final_message=continue_final_message and final is None,
        )
        think = self.reasoning
        if final is not None:
            reasoning, content = split_think(self._body(final))
            reasoning_text = "\n" + reasoning.strip("\n") + "\n"
            content_text = "\n\n" + content.lstrip("\n")
            ids += [
                think.open_id,
                *encode_client_text(self.tokenizer, reasoning_text, self.markers),
            ]
            ids += [think.close_id, *encode_client_text(self.tokenizer, content_text, self.markers)]
            if continue_final_message:
                return ids
            ids += [self.im_end_id, *self.newline_ids]
            if add_generation_prompt:
                ids += [self.im_start_id, *self.tokenizer.encode("assistant\n")]
        if add_generation_prompt and not continue_final_message and enable_thinking is False:
            ids += [think.open_id, *self.tokenizer.encode("\n\n"), think.close_id]
            ids += self.tokenizer.encode("\n\n")
        return ids

    def _encode_turns(self, turns: Sequence[Sequence[Piece]]) -> list[list[int]]:
        return [
            [
                i
                for p in join_pieces(t)
                for i in (
                    encode_client_text(self.tokenizer, p, self.markers)
                    if isinstance(p, str)
                    else [p]
                )
            ]
            for t in turns
        ]


def _history(m: ChatMessage) -> ChatMessage:
    """An assistant turn as history: its content only."""
    if m.role != "assistant" or THINK_CLOSE not in m.content:
        return m
    return replace(m, content=split_think(m.content)[1].lstrip("\n"))


def _last_query_index(turns: Sequence[ChatMessage]) -> int:
    """The last user message that is not a tool response written by hand (Qwen3's rule)."""
    for k in range(len(turns) - 1, -1, -1):
        m = turns[k]
        wrapped = m.content.startswith("<tool_response>") and m.content.endswith("</tool_response>")
        if m.role == "user" and not wrapped:
            return k
    return len(turns) - 1


class DeepSeekR1Recipe(ChatRecipe):
    family = "DeepSeek-R1"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        names = (R1_USER, R1_ASSISTANT)
        ids = [tokenizer.token_to_id(n) for n in names]
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if any(i is None or i not in tokenizer.added_token_ids for i in ids):
            raise ModelLoadError(
                f"DeepSeek-R1 chat template, but {', '.join(names)} are not tokens of the "
                "vocabulary (a GGUF vocabulary drops control tokens spelled outside its byte "
                "alphabet: load the model's tokenizer.json instead)"
            )
        if bos is None or eos is None:
            raise ModelLoadError("DeepSeek-R1 chat template, but the vocabulary lacks BOS or EOS")
        self.user_id, self.assistant_id = (i for i in ids if i is not None)
        self.bos_id, self.eos_id = bos, eos
        self.reasoning = reasoning_format(tokenizer, self.family, prompt_opens=True)
        self.markers = (R1_USER, R1_ASSISTANT, THINK_OPEN, THINK_CLOSE)
        """Added tokens the format writes; the vocabulary's own make them no control tokens
        (typed text would match them), so client text is encoded cut inside each."""

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
        why = "deepinfer writes tool calls in ChatML only, not in this model's DeepSeek-R1 format"
        system, turns = self._without_tools(messages, tools, why)
        for i, m in enumerate(messages):
            if m.role == "tool":
                raise InvalidRequestError(
                    f"messages[{i}].role is 'tool': {why}", param=f"messages[{i}].role"
                )
        if continue_final_message:
            self._check_prefill(turns)
        systems = [self._body(m) for m in turns if m.role == "system"]
        system = self._with_effort(systems[-1] if systems else system, reasoning_effort)
        pieces: list[Piece] = [self.bos_id, system or ""]
        for m in turns:
            if m.role == "user":
                pieces += [self.user_id, self._body(m)]
            elif m.role == "assistant":
                pieces += [self.assistant_id, split_think(self._body(m))[1], self.eos_id]
        if continue_final_message:
            pieces.pop()  # the final turn stays open
        elif add_generation_prompt:
            pieces += [self.assistant_id, self.reasoning.open_id, "\n"]
        return [
            i
            for p in join_pieces(pieces)
            for i in (
                encode_client_text(self.tokenizer, p, self.markers) if isinstance(p, str) else [p]
            )
        ]
