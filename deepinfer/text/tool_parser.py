"""Incremental parsing of an answer into content and tool calls, as it streams.

The family's `CallMarkup` (`tool_markup.py`) says how calls are written; Hermes-style
`<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>` blocks by default. Calls
become call events; all other text is content. The split does not depend on how the answer is
cut into pieces.

- Text that could be the start of the opener is held back until it is known not to be.
- A call is committed once its header (`{"name": "NAME", "arguments": ` then `{`) has been read;
  from then on its arguments stream as they arrive, up to the brace that closes the object.
  Then the rest of the call is consumed: Hermes' optional `}` and `</tool_call>` (other text
  after them is content, less the whitespace that follows a closed call); elsewhere the call
  object up to its closing brace, then in a list `,` and the next call, or `]`.
- A block whose header is malformed is content, verbatim (a shown control token opening it is
  dropped, as decoding drops it).
- The end of the answer (`max_tokens`, a stop string) never turns markup into content: a call cut
  off before its header is complete is dropped, and so are a cut closer (`</tool_call>`) after a
  call and a trailing proper prefix of the opener (an answer ending in `<tool_` loses those
  characters).
- Arguments are the model's text: a call cut off by the end of the answer, or whose arguments
  meet `<` outside a string, ends with the arguments it has (possibly not valid JSON, as
  OpenAI's API documents); `truncated` tells whether the last call was cut off.
- With `max_calls`, later well-formed calls are consumed and dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from deepinfer.text.detokenizer import CONTROL_MARK
from deepinfer.text.tool_markup import CallMarkup
from deepinfer.text.tools import HERMES_MARKUP

_WS = " \t\r\n"
_MAX_HEADER_CHARS = 1024


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: its first delta has the name (arguments ""), then fragments."""

    index: int
    name: str | None
    arguments: str


ParseEvent = ContentDelta | CallDelta


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass
class ParsedAnswer:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class _State(Enum):
    TEXT = 0
    LIST = 1
    HEADER = 2
    ARGS = 3
    AFTER = 4
    NEXT = 5


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _read_string(text: str, at: int) -> tuple[str | None, int, bool]:
    """(raw string body, index after its closing quote, viable) for a JSON string at `at`."""
    k = at + 1
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2
            continue
        if c == '"':
            return text[at + 1 : k], k + 1, True
        if c < " ":
            return None, k, False
        k += 1
    return None, len(text), True


def _skip_ws(text: str, k: int) -> int:
    while k < len(text) and text[k] in _WS:
        k += 1
    return k


def parse_header(text: str, args_key: str = "arguments") -> tuple[str | None, int, bool]:
    """(name, index of the arguments' `{`, viable): name is set once the header is complete;
    viable is False as soon as `text` cannot begin a well-formed header. The header's tokens:
    `{`, `"name"`, `:`, the name (a JSON string), `,`, `"<args_key>"`, `:`, whitespace allowed
    between them."""
    k, name = 0, None
    for token in ("{", '"name"', ":", None, ",", f'"{args_key}"', ":"):
        k = _skip_ws(text, k)
        if k == len(text):
            return None, k, True
        if token is None:
            if text[k] != '"':
                return None, k, False
            raw, k, ok = _read_string(text, k)
            if raw is None:
                return None, k, ok
            try:
                name = json.loads(f'"{raw}"')
            except json.JSONDecodeError:
                return None, k, False
            continue
        end = k + len(token)
        if not token.startswith(text[k:end]):
            return None, k, False
        if end > len(text):
            return None, len(text), True
        k = end
    k = _skip_ws(text, k)
    if k == len(text):
        return None, k, True
    return (name, k, True) if text[k] == "{" else (None, k, False)


class ToolCallParser:
    """Feed answer text as it arrives; read content and call deltas back."""

    def __init__(self, max_calls: int | None = None, markup: CallMarkup = HERMES_MARKUP) -> None:
        self.markup = markup
        limits = [n for n in (max_calls, markup.max_calls) if n is not None]
        self.max_calls = min(limits) if limits else None
        self.num_calls = 0
        self._state = _State.TEXT
        self._buf = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._after_call = False
        self._at_start = True
        """Nothing but whitespace read yet (where `bare_start` opens a call)."""
        self._opened = ""
        """The text that opened the block being read: content again if it is not a call."""
        self._events: list[ParseEvent] = []
        self.truncated = False
        """The answer ended inside a reported call's arguments (set by `finish`)."""

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ParseEvent]:
        """The rest, at the end of the answer: held text is content, an open call ends."""
        self._run(final=True)
        return self._take()

    def _take(self) -> list[ParseEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: ParseEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            self._events[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, CallDelta) and isinstance(last, CallDelta) and event.name is None:
            self._events[-1] = CallDelta(last.index, last.name, last.arguments + event.arguments)
        else:
            self._events.append(event)

    def _content(self, text: str) -> None:
        text = text.replace(CONTROL_MARK, "")  # a shown token outside a call reads as decoded
        if text:
            self._emit(ContentDelta(text))

    @property
    def _live(self) -> bool:
        """Whether the current call is reported (not dropped by `max_calls`)."""
        return self.max_calls is None or self.num_calls <= self.max_calls

    def _run(self, final: bool) -> None:
        while True:
            state, size = self._state, len(self._buf)
            step = {
                _State.TEXT: self._text,
                _State.LIST: self._list,
                _State.HEADER: self._header,
                _State.ARGS: self._args,
                _State.AFTER: self._after,
                _State.NEXT: self._next,
            }[state]
            step(final)
            if self._state is state and len(self._buf) == size:
                return

    def _text(self, final: bool) -> None:
        if self._after_call:  # whitespace between or after calls is layout, not content
            stripped = self._buf.lstrip(_WS)
            if not stripped and not final:
                return
            self._buf, self._after_call = stripped, False
        if self._at_start and self.markup.bare_start:
            rest = self._buf.lstrip(_WS)
            if not rest and not final:
                return
            self._at_start = False
            if rest.startswith("{"):
                self._open(self._buf[: len(self._buf) - len(rest)], rest)
                return
        opener = self.markup.opener
        at = self._buf.find(opener) if opener else -1
        if at >= 0:
            self._content(self._buf[:at])
            self._open(opener, self._buf[at + len(opener) :])
            return
        keep = _held_prefix(self._buf, opener) if opener else 0
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = "" if final else self._buf[len(self._buf) - keep :]

    def _open(self, opened: str, rest: str) -> None:
        self._at_start = False
        self._opened, self._buf = opened, rest
        self._state = _State.LIST if self.markup.in_list else _State.HEADER

    def _not_a_call(self) -> None:
        """The block read so far is content (its opener included); the rest is scanned again."""
        self._content(self._opened)
        self._opened, self._state = "", _State.TEXT

    def _list(self, final: bool) -> None:
        rest = self._buf.lstrip(_WS)
        if rest.startswith("["):
            self._buf, self._state = rest[1:], _State.HEADER
        elif rest or final:
            self._not_a_call()

    def _header(self, final: bool) -> None:
        name, at, viable = parse_header(self._buf, self.markup.args_key)
        if name is not None:
            self.num_calls += 1
            if self._live:
                self._emit(CallDelta(self.num_calls - 1, name, ""))
            self._buf, self._state = self._buf[at:], _State.ARGS
            self._depth, self._in_string, self._escaped = 0, False, False
        elif not viable or len(self._buf) > _MAX_HEADER_CHARS:
            self._not_a_call()
        elif final:  # a call cut off before its name: nothing to report
            self._opened, self._buf, self._state = "", "", _State.TEXT

    def _args(self, final: bool) -> None:
        end = self._scan(self._buf)
        if end is None and not final:
            self._arguments(self._buf)
            self._buf = ""
            return
        if end is None:
            end, self.truncated = len(self._buf), self._live
        self._arguments(self._buf[:end])
        self._buf, self._state = self._buf[end:], _State.AFTER
        self._depth, self._in_string, self._escaped = 1, False, False

    def _arguments(self, text: str) -> None:
        if text and self._live:
            self._emit(CallDelta(self.num_calls - 1, None, text))

    def _scan(self, text: str) -> int | None:
        """Index just past the brace that brings the depth to 0 (or at a stray `<`), if in
        `text`; the string and depth state carries over between pieces."""
        for k, c in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return k + 1
            elif c == "<":
                return k
        return None

    def _after(self, final: bool) -> None:
        closer = self.markup.closer
        if closer:  # Hermes: an optional `}`, then the closing tag
            rest = self._buf.lstrip(_WS)
            rest = rest[1:].lstrip(_WS) if rest.startswith("}") else rest
            if rest.startswith(closer):
                self._buf, self._state = rest[len(closer) :], _State.TEXT
                self._after_call = True
            elif final or not closer.startswith(rest):
                cut_close = final and closer.startswith(rest)
                self._buf, self._state = "" if cut_close else rest, _State.TEXT
            return
        end = self._scan(self._buf)  # the rest of the call object (an "id"), dropped
        if end is None and not final:
            self._buf = ""
            return
        self._buf = self._buf[len(self._buf) if end is None else end :]
        self._state = _State.NEXT if self.markup.in_list else _State.TEXT
        self._after_call = not self.markup.in_list

    def _next(self, final: bool) -> None:
        """In a list of calls: `,` and another call, or `]` and text."""
        rest = self._buf.lstrip(_WS)
        if rest.startswith(","):
            self._opened, self._buf, self._state = "", rest[1:], _State.HEADER
        elif rest.startswith("]"):
            self._buf, self._state, self._after_call = rest[1:], _State.TEXT, True
        elif rest or final:
            self._buf, self._state = rest, _State.TEXT


def parse_answer(
    text: str, max_calls: int | None = None, markup: CallMarkup = HERMES_MARKUP
) -> ParsedAnswer:
    """A whole answer's content and calls (what streaming it piece by piece gives)."""
    parser = ToolCallParser(max_calls, markup)
    return collect_events([*parser.feed(text), *parser.finish()])


def collect_events(events: list[ParseEvent]) -> ParsedAnswer:
    answer = ParsedAnswer()
    for e in events:
        if isinstance(e, ContentDelta):
            answer.content += e.text
        elif e.name is not None:
            answer.calls.append(ParsedCall(e.name, e.arguments))
        else:
            answer.calls[e.index].arguments += e.arguments
    return answer
