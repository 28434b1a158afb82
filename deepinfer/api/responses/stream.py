"""Responses streaming: the event sequence the OpenAI SDK accumulates, each event numbered.

response.created, response.in_progress, then each output item's events (`items.py`:
a message's output_item.added, content_part.added, output_text.delta*, ...; a function call's
output_item.added, function_call_arguments.delta*, ...), then response.completed (or
response.incomplete when max_output_tokens ended it). A failure mid-stream sends an `error`
event, then response.failed.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

from deepinfer.api.http.errors import to_api_error
from deepinfer.api.http.sse import event_frame
from deepinfer.api.protocol import OutputStream
from deepinfer.api.responses.convert import status_of
from deepinfer.api.responses.items import OutputItems
from deepinfer.api.responses.pending import Pending
from deepinfer.api.responses.schemas import (
    ResponseCompleted,
    ResponseCreated,
    ResponseErrorOut,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    StreamError,
)
from deepinfer.api.responses.store import ResponseStore
from deepinfer.engine.types import GenerationOutput
from deepinfer.text.reasoning import ReasoningSplitter

_FINAL = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}


def _frame(event: Any) -> bytes:
    return event_frame(type(event).__struct_config__.tag, event)


async def response_events(
    pending: Pending,
    stream: OutputStream,
    store: ResponseStore,
    splitter: ReasoningSplitter | None = None,
) -> AsyncIterator[bytes]:
    seq = itertools.count()
    items = OutputItems(pending.plan, pending.message_id, seq, splitter)
    for event in _opening(pending, items, seq):
        yield _frame(event)
    last: GenerationOutput | None = None
    try:
        async for out in stream:
            last = out
            for event in items.feed(out.text, out.finished, out.token_ids):
                yield _frame(event)
    except Exception as exc:
        err = to_api_error(exc)
        yield _frame(StreamError(next(seq), err.message, err.code, err.param))
        failed = pending.response("failed", [], error=ResponseErrorOut("server_error", err.message))
        yield _frame(ResponseFailed(next(seq), failed))
        return
    assert last is not None and last.finish_reason is not None, "stream ended without finishing"
    status, _ = status_of(last.finish_reason)
    if status != "failed":
        for event in items.finish(status):
            yield _frame(event)
    final = pending.finish(items.items, last.finish_reason, last.usage, store)
    if final.status == "failed":
        yield _frame(ResponseFailed(next(seq), final))
    else:
        yield _frame(_FINAL[final.status](next(seq), final))


def _opening(pending: Pending, items: OutputItems, seq: Iterator[int]) -> Iterator[Any]:
    started = pending.response("in_progress", [])
    yield ResponseCreated(next(seq), started)
    yield ResponseInProgress(next(seq), started)
    yield from items.start()
