"""One Responses request between submit and its answer: what the response object echoes, the
conversation to store, and the response object at each stage."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from deepinfer.api.http.cache_options import CacheOptions
from deepinfer.api.http.errors import is_set
from deepinfer.api.responses.convert import response_usage, status_of
from deepinfer.api.responses.schemas import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCall,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    ResponseErrorOut,
    ResponseObject,
    ResponsesRequest,
    TextConfigOut,
)
from deepinfer.api.responses.store import ResponseStore
from deepinfer.api.tools.plan import ToolPlan
from deepinfer.engine.types import Usage
from deepinfer.request import FinishReason
from deepinfer.text.messages import ToolCall
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
    plan: ToolPlan
    """The request's tools: rendered into the prompt, parsed back from the answer."""

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
            parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice if is_set(req.tool_choice) else "auto",
            tools=list(req.tools or ()),
            text=_text_config(req),
        )

    def finish(
        self, output: list[OutputItem], reason: FinishReason, usage: Usage, store: ResponseStore
    ) -> ResponseObject:
        """The final response object holding `output` (its items closed by the caller with
        `status_of(reason)`); the conversation, reply included, and the object are stored when
        asked."""
        status, incomplete = status_of(reason)
        if status == "failed":
            error = ResponseErrorOut("server_error", "generation was aborted")
            return self.response(status, [], usage, error=error)
        response = self.response(status, output, usage, incomplete=incomplete)
        if self.req.store is not False:
            store.put(
                self.response_id,
                (*self.conversation, reply_message(output)),
                salt=self.cache.salt,
                retention=self.cache.retention,
                body=msgspec.json.encode(response),
            )
        return response


def reply_message(output: list[OutputItem]) -> ChatMessage:
    """The assistant turn an answer's items make (its texts, then its calls)."""
    text = "".join(
        t.text for item in output if isinstance(item, OutputMessage) for t in item.content
    )
    calls = tuple(
        ToolCall(item.name, item.arguments, item.call_id)
        for item in output
        if isinstance(item, FunctionCall)
    )
    return ChatMessage("assistant", text, tool_calls=calls)


def _text_config(req: ResponsesRequest) -> TextConfigOut:
    fmt = None if req.text is None else req.text.format
    if fmt is None or fmt.type == "text":
        return TextConfigOut()
    if fmt.type == "json_object":
        return TextConfigOut(FormatJsonObject())
    return TextConfigOut(FormatJsonSchema(fmt.name or "", fmt.schema_, fmt.strict, fmt.description))
