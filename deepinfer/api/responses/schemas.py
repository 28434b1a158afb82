"""OpenAI Responses API wire types (msgspec): the request, the response object, stream events.

Requests ignore unknown fields (clients send many). Fields the Responses API defines but the
server does not honour are declared here so that `fields.py` can refuse them (400 naming
the field) whenever they are set to anything but their default.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ---- requests


class InputPart(msgspec.Struct):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct):
    """A message (`role` + `content`), a `function_call` or a `function_call_output`."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class TextFormat(msgspec.Struct):
    type: str
    name: str | None = None
    schema_: msgspec.Raw = msgspec.field(name="schema", default=msgspec.Raw())
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(msgspec.Struct):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[InputItem] = ""
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    tools: list[msgspec.Raw] | None = None
    tool_choice: msgspec.Raw = msgspec.Raw()
    parallel_tool_calls: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    conversation: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    prompt_cache_retention: str | None = None
    prompt_cache_options: msgspec.Raw = msgspec.Raw()
    context_management: msgspec.Raw = msgspec.Raw()
    moderation: msgspec.Raw = msgspec.Raw()
    image: msgspec.Raw = msgspec.Raw()
    access_programs: msgspec.Raw = msgspec.Raw()
    background_options: msgspec.Raw = msgspec.Raw()
    cache_salt: str | None = None
    cache_retention: str | None = None

    # ---- responses


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    """A reasoning model's think block, in full (no summary is made)."""

    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = ReasoningItem | OutputMessage | FunctionCall


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseErrorOut(msgspec.Struct):
    code: str
    message: str


class FormatText(msgspec.Struct, tag_field="type", tag="text"):
    pass


class FormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class FormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema"):
    name: str
    schema_: msgspec.Raw = msgspec.field(name="schema")
    strict: bool | None = None
    description: str | None = None


FormatOut = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfigOut(msgspec.Struct):
    format: FormatOut = msgspec.field(default_factory=FormatText)


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    store: bool
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    completed_at: int | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseErrorOut | None = None
    object: str = "response"
    background: bool = False
    parallel_tool_calls: bool = True
    tool_choice: str | msgspec.Raw = "auto"
    """The request's choice as sent (a string, or a named function object)."""
    tools: list[msgspec.Raw] = msgspec.field(default_factory=list)
    """The request's tools as sent."""
    text: TextConfigOut = msgspec.field(default_factory=TextConfigOut)
    truncation: str = "disabled"
    service_tier: str = "default"


class DeletedResponse(msgspec.Struct):
    """What DELETE /v1/responses/{id} answers."""

    id: str
    object: str = "response.deleted"
    deleted: bool = True


# ---- stream events (each frame: `event: <type>` and the event as data)


class ResponseCreated(msgspec.Struct, tag_field="type", tag="response.created"):
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(msgspec.Struct, tag_field="type", tag="response.in_progress"):
    sequence_number: int
    response: ResponseObject


class ResponseCompleted(msgspec.Struct, tag_field="type", tag="response.completed"):
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(msgspec.Struct, tag_field="type", tag="response.incomplete"):
    sequence_number: int
    response: ResponseObject


class ResponseFailed(msgspec.Struct, tag_field="type", tag="response.failed"):
    sequence_number: int
    response: ResponseObject


class OutputItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(msgspec.Struct, tag_field="type", tag="response.output_item.done"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(msgspec.Struct, tag_field="type", tag="response.content_part.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class StreamError(msgspec.Struct, tag_field="type", tag="error"):
    sequence_number: int
    message: str
    code: str | None
    param: str | None


class FunctionCallArgumentsDelta(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"
):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"
):
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
