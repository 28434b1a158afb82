"""OpenAI wire types (msgspec): chat completions, completions, models.

Requests ignore unknown fields (clients send many); the vLLM extras that benchmark tools send
(ignore_eos, min_tokens, top_k, min_p, repetition_penalty, stop_token_ids) are honoured.
`tools`, `response_format` and `logit_bias` are read only so that the server's request limits
apply to them (kept raw, not interpreted); they do not change what is generated.
"""

from __future__ import annotations

import msgspec

# ---- requests


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _SamplingFields(msgspec.Struct):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    """Counted against `max_logit_bias`; not applied to sampling."""
    cache_salt: str | None = None
    cache_retention: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    tools: list[msgspec.Raw] | None = None
    """Counted and sized against `max_tools` and `max_schema_bytes`; not interpreted."""
    response_format: msgspec.Raw = msgspec.Raw()
    """Sized against `max_schema_bytes` (empty when absent; msgspec takes no `Raw | None`); not
    interpreted."""


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


# ---- responses


class CachedTokensDetails(msgspec.Struct):
    """deepinfer extension: which prefix-cache tier served the cached prompt tokens."""

    device: int
    disk: int
    host: int = 0


class PromptTokensDetails(msgspec.Struct, omit_defaults=True):
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails | None = None
    """deepinfer extension, present when `cached_tokens` > 0 (SDKs keep unknown keys)."""


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
