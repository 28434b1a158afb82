"""Llama 3.1's tool format: JSON tool calling, as Meta's Llama 3.1 and 3.3 templates write it.

Rendering (turns as in `recipe_families.py`: `<|start_header_id|>` role `<|end_header_id|>`
"\\n\\n" + text `<|eot_id|>`):
- With tool definitions the system turn starts with "Environment: ipython\\n", and the first
  message after the system prompt (a user message) carries them: `USER_HEAD`, then each
  definition as JSON indented by 4 and "\\n\\n", then its own text, stripped.
- An assistant turn with a call is the call object alone, `{"name": "NAME", "parameters": ARGS}`
  (its content is not written, as the templates drop it); the format holds one call a turn.
- A tool result is an `ipython` turn holding the result as a JSON string.

Calls in an answer: one call object, either the whole answer (the templates prompt for bare
JSON, and a call ends the turn) or after `<|python_tag|>`, a control token that text cannot
spell. Injection: nothing a client sends becomes a control token (every text is content), and
no text inside an answer becomes a call; but a bare-JSON call has no marker at all, so an answer
that is nothing but a call object is a call whoever wrote it. A model told by a document or a
tool result to answer with exactly such an object emits a call; that is this format's nature
(the model's answer is the call), which no parser can tell apart, and clients must treat calls
from Llama 3.1 models as they treat its text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from deepinfer.text.detokenizer import CONTROL_MARK
from deepinfer.text.messages import ToolCall, ToolSpec
from deepinfer.text.tool_markup import CallMarkup, json_head

ENVIRONMENT = "Environment: ipython\n"
USER_HEAD = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n"
)
ARGS_KEY = "parameters"


class Llama3Tools:
    """Llama 3.1's tool texts; `python_tag_id` is `<|python_tag|>` when it is a control token."""

    def __init__(self, python_tag_id: int | None) -> None:
        self.python_tag_id = python_tag_id

    @property
    def markup(self) -> CallMarkup:
        tag = self.python_tag_id
        return CallMarkup(
            head=json_head(ARGS_KEY),
            args_key=ARGS_KEY,
            max_calls=1,
            opener=CONTROL_MARK if tag is not None else "",
            bare_start=True,
            shown_ids=() if tag is None else (tag,),
        )

    @staticmethod
    def first_user_text(text: str, tools: Sequence[ToolSpec]) -> str:
        """The first user turn's text with the definitions ahead of it."""
        defs = "".join(
            json.dumps(json.loads(t.definition), ensure_ascii=False, indent=4) + "\n\n"
            for t in tools
        )
        return USER_HEAD + defs + text.strip()

    @staticmethod
    def call_text(call: ToolCall) -> str:
        return json_head(ARGS_KEY)(call.name) + call.arguments + "}"

    @staticmethod
    def result_text(content: str) -> str:
        return json.dumps(content, ensure_ascii=False)
