"""Responses streaming: the event sequence the OpenAI SDK accumulates, each event numbered.

response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta*, response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens ended it). A failure mid-stream sends an `error`
event, then response.failed.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

from deepinfer.api.errors import to_api_error
from deepinfer.api.protocol import OutputStream
from deepinfer.api.responses_pending import Pending
from deepinfer.api.responses_schemas import (
    ContentPartAdded,
    ContentPartDone,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseErrorOut,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    StreamError,
)
from deepinfer.api.responses_store import ResponseStore
from deepinfer.api.sse import event_frame
from deepinfer.engine.types import GenerationOutput

_FINAL = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}


def _frame(event: Any) -> bytes:
    return event_frame(type(event).__struct_config__.tag, event)


async def response_events(
    pending: Pending, stream: OutputStream, store: ResponseStore
) -> AsyncIterator[bytes]:
    seq = itertools.count()
    texts: list[str] = []
    for event in _opening(pending, seq):
        yield _frame(event)
    last: GenerationOutput | None = None
    try:
        async for out in stream:
            last = out
            if out.text:
                texts.append(out.text)
                delta = OutputTextDelta(next(seq), pending.message_id, 0, 0, out.text)
                yield _frame(delta)
    except Exception as exc:
        err = to_api_error(exc)
        yield _frame(StreamError(next(seq), err.message, err.code, err.param))
        failed = pending.response("failed", [], error=ResponseErrorOut("server_error", err.message))
        yield _frame(ResponseFailed(next(seq), failed))
        return
    assert last is not None and last.finish_reason is not None, "stream ended without finishing"
    final = pending.finish("".join(texts), last.finish_reason, last.usage, store)
    for event in _closing(pending, final.status, "".join(texts), seq):
        yield _frame(event)
    if final.status == "failed":
        yield _frame(ResponseFailed(next(seq), final))
    else:
        yield _frame(_FINAL[final.status](next(seq), final))


def _opening(pending: Pending, seq: Iterator[int]) -> Iterator[Any]:
    started = pending.response("in_progress", [])
    yield ResponseCreated(next(seq), started)
    yield ResponseInProgress(next(seq), started)
    yield OutputItemAdded(next(seq), 0, pending.message("", "in_progress"))
    yield ContentPartAdded(next(seq), pending.message_id, 0, 0, OutputText(""))


def _closing(pending: Pending, status: str, text: str, seq: Iterator[int]) -> Iterator[Any]:
    if status == "failed":
        return
    mid = pending.message_id
    yield OutputTextDone(next(seq), mid, 0, 0, text)
    yield ContentPartDone(next(seq), mid, 0, 0, OutputText(text))
    item_status = "completed" if status == "completed" else "incomplete"
    yield OutputItemDone(next(seq), 0, pending.message(text, item_status))
