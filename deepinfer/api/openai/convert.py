"""OpenAI request fields -> engine inputs, and engine outputs -> OpenAI response pieces."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.openai.schemas import (
    CachedTokensDetails,
    ChatMessageIn,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionTokensDetails,
    PredictionContent,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageOut,
    _SamplingFields,
)
from deepinfer.api.openai.tools import history_calls
from deepinfer.api.protocol import TokenizerLike
from deepinfer.api.tools.structured import logit_bias_pairs, openai_spec
from deepinfer.engine.types import Usage
from deepinfer.errors import InvalidRequestError
from deepinfer.outputs import SampledToken
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.recipe import ChatMessage

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {message}", param=param)


def chat_messages(messages: Sequence[ChatMessageIn]) -> list[ChatMessage]:
    """Validate roles, content (text only) and tool calls; 400 naming the first bad field."""
    if not messages:
        raise invalid("messages", "must hold at least one message")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise invalid(
                f"messages[{i}].role",
                f"unsupported role {m.role!r}; use one of {sorted(_ROLES)}",
            )
        if role == "tool" and m.tool_call_id is None:
            raise invalid(f"messages[{i}].tool_call_id", "a tool message needs tool_call_id")
        content = _content_text(m, f"messages[{i}].content")
        calls = history_calls(m, i) if role == "assistant" else ()
        call_id = m.tool_call_id if role == "tool" else None
        out.append(ChatMessage(role, content, m.name, calls, call_id))
    return out


def _content_text(m: ChatMessageIn, param: str) -> str:
    if isinstance(m.content, str):
        return m.content
    if m.content is None:
        if m.role == "assistant":
            return ""
        raise invalid(param, f"a {m.role} message needs content")
    texts: list[str] = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise invalid(
                f"{param}[{j}].type", f"unsupported content part {part.type!r}; use 'text'"
            )
        if part.text is None:
            raise invalid(f"{param}[{j}].text", "a text part needs text")
        texts.append(part.text)
    return "".join(texts)


def prediction_text(raw: msgspec.Raw) -> str | None:
    """The text of a chat request's `prediction` (Predicted Outputs), None when not sent or
    empty; 400 naming the field when it is not `{"type": "content", "content": ...}` with text
    or text parts."""
    if not raw:
        return None
    try:
        found = msgspec.json.decode(raw, type=PredictionContent | None)
    except msgspec.ValidationError as exc:
        raise invalid(
            "prediction", f"expected {{'type': 'content', 'content': text}}: {exc}"
        ) from None
    if found is None:
        return None
    if found.type != "content":
        raise invalid("prediction.type", f"only 'content' is supported, got {found.type!r}")
    if isinstance(found.content, str):
        return found.content or None
    texts: list[str] = []
    for i, part in enumerate(found.content):
        if part.type != "text" or part.text is None:
            raise invalid(f"prediction.content[{i}]", "only text parts are supported")
        texts.append(part.text)
    return "".join(texts) or None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Build validated SamplingParams; choice i > 0 of a seeded request uses seed + i."""
    top_k = req.top_k if req.top_k is not None else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=None if req.seed is None else req.seed + choice,
            stop=stop_strings(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logit_bias=logit_bias_pairs(req.logit_bias),
            structured=openai_spec(
                response_format=getattr(req, "response_format", msgspec.Raw()),
                guided_json=req.guided_json,
                guided_regex=req.guided_regex,
                guided_choice=req.guided_choice,
                structured_outputs=req.structured_outputs,
            ),
        )
    except InvalidRequestError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, exc.message, param=exc.param) from None


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH[reason]


def no_output(usage: Usage) -> Usage:
    """The usage of a request whose output is not returned (`max_tokens: 0` with `echo`: the
    engine sampled one token to finish the prompt's step)."""
    return dataclasses.replace(usage, completion_tokens=0)


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=usage.cached_tokens,
            cached_tokens_details=CachedTokensDetails(
                device=usage.device_cached_tokens,
                disk=usage.disk_cached_tokens,
                host=usage.host_cached_tokens,
                remote=usage.remote_cached_tokens,
            )
            if usage.cached_tokens
            else None,
        ),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=usage.accepted_prediction_tokens,
            rejected_prediction_tokens=usage.rejected_prediction_tokens,
        )
        if usage.accepted_prediction_tokens or usage.rejected_prediction_tokens
        else None,
    )


def _piece(tokenizer: TokenizerLike, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8", errors="replace"))


def chat_logprobs(
    tokenizer: TokenizerLike, tokens: Sequence[SampledToken]
) -> ChoiceLogprobs | None:
    if not tokens:
        return None
    content: list[TokenLogprob] = []
    for t in tokens:
        text, raw = _piece(tokenizer, t.token_id)
        tops: list[TopLogprob] = []
        for tid, lp in t.top_logprobs:
            top_text, top_raw = _piece(tokenizer, tid)
            tops.append(TopLogprob(top_text, finite_logprob(lp), top_raw))
        content.append(TokenLogprob(text, finite_logprob(t.logprob), raw, tops))
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: TokenizerLike, tokens: Sequence[SampledToken], text_offset: int
) -> CompletionLogprobs | None:
    if not tokens:
        return None
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    assert out.top_logprobs is not None
    for t in tokens:
        text = tokenizer.decode([t.token_id])
        out.tokens.append(text)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append(
            {tokenizer.decode([tid]): finite_logprob(lp) for tid, lp in t.top_logprobs}
        )
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def finite_logprob(logprob: float | None) -> float:
    """JSON has no -inf: clamp like OpenAI does (-9999.0)."""
    if logprob is None or logprob != logprob or logprob < -9999.0:
        return -9999.0
    return logprob
