"""One Responses request between submit and its answer: what the response object echoes, the
conversation to store, and the response object at each stage."""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepinfer.api.cache_options import CacheOptions
from deepinfer.api.responses_convert import response_usage, status_of
from deepinfer.api.responses_schemas import (
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseErrorOut,
    ResponseObject,
    ResponsesRequest,
)
from deepinfer.api.responses_store import ResponseStore
from deepinfer.engine.types import Usage
from deepinfer.request import FinishReason
from deepinfer.text.recipe import ChatMessage


@dataclass(frozen=True)
class Pending:
    response_id: str
    message_id: str
    created_at: int
    model: str
    req: ResponsesRequest
    conversation: tuple[ChatMessage, ...]
    """The stored history, then this request's turns (instructions are not part of it)."""
    cache: CacheOptions
    prompt_ids: list[int]

    @property
    def num_prompt_ids(self) -> int:
        return len(self.prompt_ids)

    def response(
        self,
        status: str,
        output: list[OutputItem],
        usage: Usage | None = None,
        *,
        incomplete: IncompleteDetails | None = None,
        error: ResponseErrorOut | None = None,
    ) -> ResponseObject:
        req = self.req
        done = status in ("completed", "incomplete")
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            usage=None if usage is None else response_usage(usage),
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {},
            previous_response_id=req.previous_response_id,
            temperature=req.temperature,
            top_p=req.top_p,
            store=req.store is not False,
            user=req.user,
            reasoning=req.reasoning,
            completed_at=int(time.time()) if done else None,
            incomplete_details=incomplete,
            error=error,
        )

    def message(self, text: str, status: str) -> OutputMessage:
        content = [] if status == "in_progress" else [OutputText(text)]
        return OutputMessage(self.message_id, status, content)

    def finish(
        self, text: str, reason: FinishReason, usage: Usage, store: ResponseStore
    ) -> ResponseObject:
        """The final response object; the conversation, reply included, is stored when asked."""
        status, incomplete = status_of(reason)
        if status == "failed":
            error = ResponseErrorOut("server_error", "generation was aborted")
            return self.response(status, [], usage, error=error)
        item_status = "completed" if status == "completed" else "incomplete"
        if self.req.store is not False:
            reply = ChatMessage("assistant", text)
            store.put(
                self.response_id,
                (*self.conversation, reply),
                salt=self.cache.salt,
                retention=self.cache.retention,
            )
        return self.response(
            status, [self.message(text, item_status)], usage, incomplete=incomplete
        )
