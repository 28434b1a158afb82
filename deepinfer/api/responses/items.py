"""A Responses answer as output items, and the stream events that build them, as it arrives.

Text is a `message` item, each call a `function_call` item (id `fc_...`, call id `call_...`),
in the order the answer writes them; a reasoning model's think block comes first, as a
`reasoning` item (id `rs_...`: output_item.added, reasoning_text.delta*, reasoning_text.done,
output_item.done). Without tools or reasoning one message is opened at once; otherwise an item
opens when its first piece arrives. Per message: output_item.added,
content_part.added, output_text.delta*, output_text.done, content_part.done,
output_item.done; per call: output_item.added, function_call_arguments.delta*,
function_call_arguments.done, output_item.done. A whole answer goes through the same path, so
both kinds of response hold the same items.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from deepinfer.api.context import new_id
from deepinfer.api.responses.schemas import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCall,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
)
from deepinfer.api.responses.tools import CALL_ID_PREFIX, ITEM_ID_PREFIX
from deepinfer.api.tools.plan import ToolPlan, ToolStream
from deepinfer.text.reasoning import ReasoningSplitter
from deepinfer.text.tool_parser import CallDelta, ContentDelta, ParseEvent


class OutputItems:
    """One answer's items; `seq` numbers the events (shared with the response's own)."""

    def __init__(
        self,
        plan: ToolPlan,
        message_id: str,
        seq: Iterator[int],
        splitter: ReasoningSplitter | None = None,
    ) -> None:
        self.tools = ToolStream(plan, CALL_ID_PREFIX) if plan.parses_calls else None
        self.splitter = splitter
        self.items: list[OutputItem] = []
        self._seq = seq
        self._message_id: str | None = message_id
        self._open: OutputItem | None = None
        self._parts: list[str] = []

    def start(self) -> Iterator[Any]:
        """Events before the answer: without tools or reasoning, its message opens at once."""
        if self.tools is None and self.splitter is None:
            yield from self._open_message()

    def feed(self, text: str, finished: bool, token_ids: Sequence[int] = ()) -> Iterator[Any]:
        """Events of one delta (`token_ids`: the ids behind `text`, for the reasoning split)."""
        if self.splitter is not None:
            thought, text = self.splitter.feed_parts(text, token_ids)
            if thought:
                yield from self._reason(thought)
        if self.tools is None:
            events: list[ParseEvent] = [ContentDelta(text)] if text else []
        else:
            events = self.tools.feed(text, finished)
        for e in events:
            yield from self._event(e)

    def finish(self, status: str) -> Iterator[Any]:
        """Close the open item: `incomplete` when the answer was cut off inside it (a message,
        or a call's arguments), else `completed`; an answer with no message or call gets an
        empty message (after its reasoning)."""
        if not any(isinstance(item, OutputMessage | FunctionCall) for item in self.items):
            yield from self._close("completed")
            yield from self._open_message()
        whole_call = isinstance(self._open, FunctionCall) and not (
            self.tools is not None and self.tools.truncated
        )
        yield from self._close("completed" if status == "completed" or whole_call else "incomplete")

    def _event(self, e: ParseEvent) -> Iterator[Any]:
        if isinstance(e, ContentDelta):
            if not isinstance(self._open, OutputMessage):
                yield from self._close("completed")
                yield from self._open_message()
            self._parts.append(e.text)
            yield OutputTextDelta(next(self._seq), self._item_id, self._index, 0, e.text)
        elif isinstance(e, CallDelta) and self.tools is not None:
            if e.name is not None:
                yield from self._close("completed")
                yield from self._open_call(self.tools.ids[e.index], e.name)
            if e.arguments:
                self._parts.append(e.arguments)
                yield FunctionCallArgumentsDelta(
                    next(self._seq), self._item_id, self._index, e.arguments
                )

    def _reason(self, text: str) -> Iterator[Any]:
        if not isinstance(self._open, ReasoningItem):
            yield from self._close("completed")
            self._add(ReasoningItem(new_id("rs_"), "in_progress", []))
            yield OutputItemAdded(next(self._seq), self._index, self.items[-1])
        self._parts.append(text)
        yield ReasoningTextDelta(next(self._seq), self._item_id, self._index, 0, text)

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    @property
    def _item_id(self) -> str:
        assert self._open is not None, "an item is open"
        return self._open.id

    def _open_message(self) -> Iterator[Any]:
        message_id, self._message_id = self._message_id or new_id("msg_"), None
        self._add(OutputMessage(message_id, "in_progress", []))
        yield OutputItemAdded(next(self._seq), self._index, self.items[-1])
        part = ContentPartAdded(next(self._seq), message_id, self._index, 0, OutputText(""))
        yield part

    def _open_call(self, call_id: str, name: str) -> Iterator[Any]:
        item_id = f"{ITEM_ID_PREFIX}{call_id.removeprefix(CALL_ID_PREFIX)}"
        self._add(FunctionCall(item_id, call_id, name, "", "in_progress"))
        yield OutputItemAdded(next(self._seq), self._index, self.items[-1])

    def _add(self, item: OutputItem) -> None:
        self.items.append(item)
        self._open, self._parts = item, []

    def _close(self, status: str) -> Iterator[Any]:
        item, text, index = self._open, "".join(self._parts), self._index
        if item is None:
            return
        seq = self._seq
        if isinstance(item, OutputMessage):
            yield OutputTextDone(next(seq), item.id, index, 0, text)
            yield ContentPartDone(next(seq), item.id, index, 0, OutputText(text))
            done: OutputItem = OutputMessage(item.id, status, [OutputText(text)])
        elif isinstance(item, ReasoningItem):
            yield ReasoningTextDone(next(seq), item.id, index, 0, text)
            done = ReasoningItem(item.id, status, [ReasoningText(text)])
        else:
            yield FunctionCallArgumentsDone(next(seq), item.id, index, text)
            done = FunctionCall(item.id, item.call_id, item.name, text, status)
        self.items[index], self._open = done, None
        yield OutputItemDone(next(seq), index, done)


def whole_answer(
    plan: ToolPlan,
    message_id: str,
    text: str,
    status: str,
    splitter: ReasoningSplitter | None = None,
    token_ids: Sequence[int] = (),
) -> list[OutputItem]:
    """The items of an answer read at once (the events are built and dropped)."""
    items = OutputItems(plan, message_id, itertools.count(), splitter)
    feed = items.feed(text, True, token_ids)
    for _ in itertools.chain(items.start(), feed, items.finish(status)):
        pass
    return items.items
