"""Mistral's tool format (v3 tokenizer: Mistral-7B-Instruct-v0.3, Mistral-Large-2407), as its
chat template writes it and `mistral_common` (Mistral's reference tokenization) encodes it.

Rendering (pieces; `[X]` is the control token, every other stretch is content text):
- Definitions, before the last user turn: `[AVAILABLE_TOOLS]` " [" + one
  `{"type": "function", "function": FUNCTION}` per tool (FUNCTION the definition's `function`
  object as JSON, less a `return` key), joined by ", " + "]" `[/AVAILABLE_TOOLS]`.
- An assistant turn with calls: `[TOOL_CALLS]` " " + the JSON list of
  `{"name": NAME, "arguments": ARGS, "id": ID}`, then EOS (its content is not written, as the
  template drops it).
- A tool result: `[TOOL_RESULTS]` " " + `{"content": CONTENT, "call_id": ID}` `[/TOOL_RESULTS]`.

Where the template and `mistral_common` differ, this follows `mistral_common` (what the models
were trained on): the system prompt opens the last user turn even when calls or results follow
it (the template shows it only when that turn ends the conversation, so a conversation ending
in tool results loses it); a result whose text is not JSON is a JSON string (the template writes
it bare, which is not JSON); string values of a definition are JSON-escaped (the template writes
them raw). Call ids are 9 letters or digits (the template refuses others):
a client's id is cut to its last 9 letters and digits (zeros in front when shorter), the same
for a call and the result answering it.

Calls in an answer: `[TOOL_CALLS]` then a JSON list of call objects (an `"id"` the model adds
is read and dropped). Injection: every marker is a control token, which client text cannot
become, and the parser only opens calls at the shown `[TOOL_CALLS]` token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from deepinfer.text.detokenizer import CONTROL_MARK
from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from deepinfer.text.tool_markup import CallMarkup, Piece, json_head

TOOL_TOKENS = (
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
CALL_ID_CHARS = 9


def call_id(raw: str | None) -> str:
    """A client's call id as the format takes it: its last 9 ASCII letters and digits."""
    kept = "".join(c for c in raw or "" if c.isascii() and c.isalnum())
    return kept[-CALL_ID_CHARS:].rjust(CALL_ID_CHARS, "0")


def _content_json(content: str) -> str:
    """A result's content as JSON: the JSON document it holds, else a JSON string."""
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        value = content
    return json.dumps(value, ensure_ascii=False)


class MistralTools:
    """Mistral's tool pieces, given the ids of its five tool control tokens (`TOOL_TOKENS`)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        (
            self.available_id,
            self.available_end_id,
            self.calls_id,
            self.results_id,
            self.results_end_id,
        ) = token_ids

    @property
    def markup(self) -> CallMarkup:
        return CallMarkup(
            head=json_head("arguments"),
            prefix=(self.calls_id, " ["),
            separator=", ",
            suffix=("]",),
            opener=CONTROL_MARK,
            in_list=True,
            shown_ids=(self.calls_id,),
        )

    def definitions(self, tools: Sequence[ToolSpec]) -> list[Piece]:
        defs = []
        for t in tools:
            function = json.loads(t.definition).get("function", {})
            kept = {k: v for k, v in function.items() if k != "return"}
            defs.append(
                f'{{"type": "function", "function": {json.dumps(kept, ensure_ascii=False)}}}'
            )
        return [self.available_id, " [" + ", ".join(defs) + "]", self.available_end_id]

    def calls(self, calls: Sequence[ToolCall]) -> list[Piece]:
        objects = [
            f'{json_head("arguments")(c.name)}{c.arguments}, "id": "{call_id(c.id)}"}}'
            for c in calls
        ]
        return [self.calls_id, " [" + ", ".join(objects) + "]"]

    def result(self, m: ChatMessage) -> list[Piece]:
        body = f'{{"content": {_content_json(m.content)}, "call_id": "{call_id(m.tool_call_id)}"}}'
        return [self.results_id, " " + body, self.results_end_id]
