"""OpenAI wire types (msgspec): chat completions, completions, models; the request fields
declared but not honoured, and their 400.

Every body field the official SDK sends is declared: honoured, refused when set to a value that
would need honouring (`check_refused`), or informational (`INFORMATIONAL_FIELDS`). Requests
ignore unknown fields (clients send many); the vLLM extras that benchmark tools send
(ignore_eos, min_tokens, top_k, min_p, repetition_penalty, stop_token_ids) are honoured.
`response_format`, vLLM's guided fields and `logit_bias` constrain sampling
(`api/tools/structured.py`); the raw ones are kept raw for the request limits first. `tools` are
kept raw for the limits, then decoded as `FunctionTool`s (`api/tools/plan.py`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.api.http.errors import is_set, refuse_set, unsupported
from deepinfer.kv_transfer.params import KVTransferParams

# ---- refused fields

_TIERS = (None, "auto", "default")

INFORMATIONAL_FIELDS = frozenset({"model", "user", "metadata", "safety_identifier"})
"""Chat and completion fields accepted without effect by design: one model is served under any
name; the server keeps no per-user state (`metadata` describes a stored completion, and
nothing is stored); prefix caching is automatic and keyed by content."""


class OpenAIRefusedFields(msgspec.Struct):
    """Chat and completion request fields (OpenAI's, and vLLM's extras) the server does not honour.

    They are declared (the base of the request types) so that a request setting one to a value
    that would need honouring gets a 400 naming it, instead of the field being dropped silently as
    an unknown one. Left at their defaults they are accepted.
    """

    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    service_tier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    audio: msgspec.Raw = msgspec.Raw()
    prediction: msgspec.Raw = msgspec.Raw()
    web_search_options: msgspec.Raw = msgspec.Raw()
    functions: list[msgspec.Raw] | None = None
    function_call: msgspec.Raw = msgspec.Raw()
    verbosity: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    moderation: msgspec.Raw = msgspec.Raw()
    prompt_cache_options: msgspec.Raw = msgspec.Raw()


def check_refused(req: OpenAIRefusedFields, *, chat: bool = False) -> None:
    """400 naming the first field set to a value this server would have to honour. Chat honours
    the prompt's fields (`add_generation_prompt`, `continue_final_message`,
    `chat_template_kwargs`: `api/prompt_options.py`); completions have no chat prompt."""
    refuse_set(
        {
            "best_of": req.best_of not in (None, 1),
            "use_beam_search": bool(req.use_beam_search),
            "length_penalty": req.length_penalty not in (None, 1.0),
            "skip_special_tokens": req.skip_special_tokens is False,
            "spaces_between_special_tokens": req.spaces_between_special_tokens is False,
            "truncate_prompt_tokens": req.truncate_prompt_tokens is not None,
            "store": bool(req.store),
            "audio": is_set(req.audio),
            "prediction": not chat and is_set(req.prediction),
            "web_search_options": is_set(req.web_search_options),
            "functions": bool(req.functions),
            "function_call": is_set(req.function_call),
            "continue_final_message": not chat and bool(req.continue_final_message),
            "chat_template": req.chat_template is not None,
            "chat_template_kwargs": not chat and is_set(req.chat_template_kwargs),
            "moderation": is_set(req.moderation),
            "prompt_cache_options": is_set(req.prompt_cache_options),
        },
        "not supported by this server",
    )
    if req.add_generation_prompt is False and not chat:
        raise unsupported("add_generation_prompt", "a completion prompt has no chat turns")
    if req.service_tier not in _TIERS:
        raise unsupported("service_tier", "only 'auto' and 'default' are supported")
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "only ['text'] is supported")
    if req.verbosity not in (None, "medium"):
        raise unsupported("verbosity", "only 'medium' is supported")


# ---- requests


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct):
    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(msgspec.Struct):
    type: str
    function: FunctionDef | None = None


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: str
    function: FunctionName


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _SamplingFields(OpenAIRefusedFields):
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
    metadata: msgspec.Raw = msgspec.Raw()
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    """Honoured: echoed in the `x-prompt-cache-key` header for routers."""
    prompt_cache_retention: str | None = None
    """Honoured: a retention class (`api/http/cache_options.py`)."""
    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    """Honoured with `--kv-transfer`: vLLM's prefill/decode fields (`kv_transfer/params.py`)."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    """Counted against `max_logit_bias`; added to the logits (api/tools/structured.py)."""
    cache_salt: str | None = None
    cache_retention: str | None = None
    guided_json: msgspec.Raw = msgspec.Raw()
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: msgspec.Raw = msgspec.Raw()
    """vLLM's constraints (api/tools/structured.py), sized against `max_schema_bytes`."""
    include_stop_str_in_output: bool | None = None
    """vLLM's: keep the matched stop string at the end of the text."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's logprob, rank and this many alternatives (0..20)."""


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    tools: list[msgspec.Raw] | None = None
    """Counted and sized against `max_tools` and `max_schema_bytes`, then decoded."""
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: msgspec.Raw = msgspec.Raw()
    """Sized against `max_schema_bytes` (empty when absent; msgspec takes no `Raw | None`);
    decoded by api/tools/structured.py."""


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
    remote: int = 0
    """Pulled from another replica before this one decoded (`--kv-transfer`)."""


class PromptTokensDetails(msgspec.Struct, omit_defaults=True):
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails | None = None
    """deepinfer extension, present when `cached_tokens` > 0 (SDKs keep unknown keys)."""


class CompletionTokensDetails(msgspec.Struct):
    """Present when the request sent a `prediction`: of its tokens, those kept as the answer's
    (verified as drafts) and the others."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class UsageOut(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class PredictionContent(msgspec.Struct):
    """OpenAI's Predicted Outputs: `{"type": "content", "content": text or text parts}`."""

    type: str
    content: str | list[ContentPart]


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


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None
    """A reasoning model's think block (vLLM's and DeepSeek's field); null without one."""


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
    kv_transfer_params: KVTransferParams | msgspec.UnsetType = msgspec.UNSET
    """What a `do_remote_decode` request kept for its consumer (vLLM's field)."""
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET
    """vLLM's place for them in a chat answer: the response's, present when asked for."""


class FunctionChunk(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """A call's first chunk has id, type and function.name; later ones argument fragments."""

    index: int
    function: FunctionChunk
    id: str | None = None
    type: str | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


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
    """The legacy shape; with `echo` the prompt's tokens come first, the first of them with
    `null` logprobs (nothing before it to condition on)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptTokenLogprob(msgspec.Struct):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobsOut = list[dict[str, PromptTokenLogprob] | None]
"""vLLM's `prompt_logprobs`: one entry per prompt token, `null` for the first."""


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET
    """Present when the request asked for `prompt_logprobs`."""


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None
    kv_transfer_params: KVTransferParams | msgspec.UnsetType = msgspec.UNSET
    """What a `do_remote_decode` request kept for its consumer (vLLM's field)."""


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
