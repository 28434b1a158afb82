"""Think blocks: how a reasoning model's template marks them, and splitting an answer into its
reasoning and its content as it streams.

A reasoning model writes `<think>` reasoning `</think>` then its answer (Qwen3), or starts inside
the block because the generation prompt opened it (DeepSeek-R1's `<think>\\n`). The split is read
from token ids, never from text: only the marker ids the model sampled count, so text that spells
`<think>` (typed by a client and echoed, or written byte by byte) stays where it is. The text
itself is the engine's (stop strings applied); a marker id's place in it is the length of the
text of the ids before it, so the split does not depend on how the answer is cut into deltas.

- Reasoning is the text between the opening marker (or the start, when the prompt opened the
  block) and the closing one, less the newlines the templates put around it (leading ones, and
  trailing ones once the block closes).
- Content is the text after the closing marker, less its leading newlines; an answer that never
  opens a block is all content; one that never closes its block is all reasoning.
- A second block opened in the content is content: only the first block is reasoning.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A template's think markers, as ids of the vocabulary."""

    open_id: int
    close_id: int
    open_text: str = THINK_OPEN
    """What `open_id` decodes to in the answer's text ("" when it is a control token)."""
    close_text: str = THINK_CLOSE
    prompt_opens: bool = False
    """The generation prompt ends inside an open block (DeepSeek-R1's `<think>\\n`)."""


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, content) of an assistant message as the templates read one: reasoning is
    what precedes the first `</think>` (after any `<think>`, newlines trimmed), content what
    follows the last (as it is: Qwen3's template trims its leading newlines, R1's does not)."""
    if THINK_CLOSE not in text:
        return "", text
    parts = text.split(THINK_CLOSE)
    return parts[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"), parts[-1]


def spelled_markers(text: str, markers: Sequence[str] = (THINK_OPEN, THINK_CLOSE)) -> list[str]:
    """`text` cut after the first character of every marker it spells, so that no piece spells
    one: encoded piece by piece, typed markers stay text (ordinary tokens) instead of matching
    the vocabulary's added tokens."""
    cuts = sorted({k + 1 for m in markers for k in _find_all(text, m)})
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _find_all(text: str, marker: str) -> list[int]:
    found, k = [], text.find(marker)
    while k >= 0:
        found.append(k)
        k = text.find(marker, k + 1)
    return found


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class AnswerDelta:
    text: str


SplitEvent = ReasoningDelta | AnswerDelta


@dataclass
class ReasoningSplitter:
    """One answer's reasoning and content, from its deltas (text and the ids behind it).

    `decode(ids)` is the text the engine's detokenizer makes of `ids` (special tokens skipped);
    it is called once per marker the answer holds, on the ids before it."""

    fmt: ReasoningFormat
    decode: Callable[[Sequence[int]], str]
    in_reasoning: bool = False
    """True when the prompt opened the block: the answer starts in it."""
    _ids: list[int] = field(default_factory=list)
    _pending: str = ""
    """The answer's text not handled yet; it starts at character `_emitted`."""
    _emitted: int = 0
    _marks: list[tuple[int, int, bool]] = field(default_factory=list)
    """(start, end, opens) of each marker in the text, in order; found from the ids."""
    _opened: bool = False
    _closed: bool = False
    _wrote_content: bool = False
    _lead: bool = True
    """Leading newlines of the current part are still being dropped."""
    _held_newlines: str = ""
    """Reasoning's trailing newlines, written only if more reasoning follows."""

    def __post_init__(self) -> None:
        self._opened = self.in_reasoning

    @property
    def has_block(self) -> bool:
        """Whether the answer opened a think block (or the prompt did)."""
        return self._opened

    def feed(self, text: str, token_ids: Sequence[int]) -> list[SplitEvent]:
        """The events of one delta: its text, and the ids behind it (the text may lag them)."""
        self._find_markers(token_ids)
        self._pending += text
        events: list[SplitEvent] = []
        while True:
            available = self._emitted + len(self._pending)
            mark = self._marks[0] if self._marks else None
            end = available if mark is None else min(mark[0], available)
            if end > self._emitted:
                self._emit(self._take(end), events)
            if mark is None or available < mark[1]:
                break
            self._take(mark[1])
            self._marks.pop(0)
            self._cross(mark[2], events)
        return events

    def feed_parts(self, text: str, token_ids: Sequence[int]) -> tuple[str, str]:
        """`feed`, as (reasoning, content) text of this delta (reasoning always comes first)."""
        events = self.feed(text, token_ids)
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        return reasoning, "".join(e.text for e in events if isinstance(e, AnswerDelta))

    def _find_markers(self, token_ids: Sequence[int]) -> None:
        for k, token_id in enumerate(token_ids):
            if token_id not in (self.fmt.open_id, self.fmt.close_id):
                continue
            opens = token_id == self.fmt.open_id
            marker = self.fmt.open_text if opens else self.fmt.close_text
            start = len(self.decode([*self._ids, *token_ids[:k]]))
            self._marks.append((start, start + len(marker), opens))
        self._ids.extend(token_ids)

    def _take(self, end: int) -> str:
        """The pending text up to character `end` of the answer, handled from here on."""
        taken, self._pending = (
            self._pending[: end - self._emitted],
            self._pending[end - self._emitted :],
        )
        self._emitted = end
        return taken

    def _cross(self, opens: bool, events: list[SplitEvent]) -> None:
        """A marker the model sampled: the first opening one (at the start) enters the block,
        the first closing one leaves it; any other is kept as text where it stands."""
        marker = self.fmt.open_text if opens else self.fmt.close_text
        if opens and not self._opened and not self._closed and not self._wrote_content:
            self._opened, self._lead, self._held_newlines = True, True, ""
            self.in_reasoning = True
        elif not opens and self.in_reasoning:
            self.in_reasoning, self._closed, self._lead = False, True, True
            self._held_newlines = ""
        elif marker:
            self._emit(marker, events)

    def _emit(self, text: str, events: list[SplitEvent]) -> None:
        if self._lead:
            text = text.lstrip("\n")
            if not text:
                return
            self._lead = False
        if not self.in_reasoning:
            self._wrote_content = self._wrote_content or bool(text.strip())
            _append(events, AnswerDelta(text))
            return
        body = text.rstrip("\n")
        held, self._held_newlines = self._held_newlines, text[len(body) :]
        if body:
            _append(events, ReasoningDelta(held + body))
        else:
            self._held_newlines = held + self._held_newlines


def _append(events: list[SplitEvent], event: SplitEvent) -> None:
    if events and type(events[-1]) is type(event):
        events[-1] = type(event)(events[-1].text + event.text)
    else:
        events.append(event)


def split_answer(
    fmt: ReasoningFormat,
    decode: Callable[[Sequence[int]], str],
    text: str,
    token_ids: Sequence[int],
    *,
    in_reasoning: bool = False,
) -> tuple[str | None, str]:
    """A whole answer's (reasoning or None when it has no block, content)."""
    splitter = ReasoningSplitter(fmt, decode, in_reasoning)
    events = splitter.feed(text, token_ids)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, AnswerDelta))
    return (reasoning if splitter.has_block else None), content
