"""How an answer writes tool calls, one `CallMarkup` per model family: the one description that
the forced-call grammar spells (`api/tools/grammar.py`) and the incremental parser reads back
(`tool_parser.py`).

An answer's calls, as the grammar spells them: `prefix`, then calls separated by `separator`,
then `suffix`; each call is `call_open`, `head(name)`, the arguments (a JSON object), then
`call_close`. Pieces are text, or a control token's id (the grammar matches that token only).

The parser reads the decoded answer, where a control token the parser needs is shown as
`CONTROL_MARK` (`detokenizer.py`, the ids in `shown_ids`) and text can never spell it:
- Hermes (`tools.py`): `<tool_call>` + object + `</tool_call>` per call, anywhere in the answer;
- Mistral (`tools_mistral.py`): `[TOOL_CALLS]` then a JSON list of call objects;
- Llama 3.1 (`tools_llama3.py`): one call object, after `<|python_tag|>` or as the whole answer.
A call object is `{"name": NAME, KEY: {...}` (KEY `arguments`, or `parameters` for Llama),
whitespace allowed between its tokens; anything after the arguments up to the object's closing
brace (Mistral's `"id"`) is read and dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Piece = str | int
"""Text to encode as content, or a marker's token id."""


def json_head(key: str) -> Callable[[str], str]:
    """The head of a call object `{"name": NAME, "<key>": ` (the name JSON-escaped)."""

    def head(name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '

    return head


@dataclass(frozen=True)
class CallMarkup:
    """One family's calls in an answer (see the module docstring)."""

    head: Callable[[str], str]
    """A call's text between `call_open` and its arguments."""
    args_key: str = "arguments"
    """The key of the arguments in a call object."""
    prefix: tuple[Piece, ...] = ()
    call_open: tuple[Piece, ...] = ()
    call_close: tuple[Piece, ...] = ("}",)
    separator: str = ""
    suffix: tuple[Piece, ...] = ()
    max_calls: int | None = None
    """At most this many calls in one answer (Llama 3.1's format holds one)."""
    opener: str = ""
    """Text of the decoded answer that opens calls (`CONTROL_MARK` for a shown control token);
    "" when only `bare_start` opens them."""
    closer: str = ""
    """Text that ends each call after its object (Hermes' `</tool_call>`); "" for none."""
    in_list: bool = False
    """After the opener, the calls are a JSON list: `[`, objects separated by `,`, `]`."""
    bare_start: bool = False
    """An answer that begins (after whitespace) with a call object is a call, opener or not."""
    shown_ids: tuple[int, ...] = ()
    """Control tokens the parser reads as `CONTROL_MARK` (`SamplingParams.shown_token_ids`)."""


@runtime_checkable
class FamilyTools(Protocol):
    """A recipe's tool format: how its family writes calls in an answer."""

    @property
    def markup(self) -> CallMarkup: ...
