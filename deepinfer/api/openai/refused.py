"""Chat and completion request fields (OpenAI's, and vLLM's extras) the server does not honour.

They are declared (the base of the request types) so that a request setting one to a value that
would need honouring gets a 400 naming it, instead of the field being dropped silently as an
unknown one. Left at their defaults they are accepted.
"""

from __future__ import annotations

import msgspec

from deepinfer.api.http.unsupported import is_set, refuse_set, unsupported

_TIERS = (None, "auto", "default")


class OpenAIRefusedFields(msgspec.Struct):
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
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
    prompt_cache_retention: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()


def check_refused(req: OpenAIRefusedFields) -> None:
    """400 naming the first field set to a value this server would have to honour."""
    refuse_set(
        {
            "best_of": req.best_of not in (None, 1),
            "use_beam_search": bool(req.use_beam_search),
            "length_penalty": req.length_penalty not in (None, 1.0),
            "include_stop_str_in_output": bool(req.include_stop_str_in_output),
            "skip_special_tokens": req.skip_special_tokens is False,
            "spaces_between_special_tokens": req.spaces_between_special_tokens is False,
            "prompt_logprobs": req.prompt_logprobs is not None,
            "truncate_prompt_tokens": req.truncate_prompt_tokens is not None,
            "store": bool(req.store),
            "audio": is_set(req.audio),
            "prediction": is_set(req.prediction),
            "web_search_options": is_set(req.web_search_options),
            "functions": bool(req.functions),
            "function_call": is_set(req.function_call),
            "prompt_cache_retention": req.prompt_cache_retention is not None,
            "continue_final_message": bool(req.continue_final_message),
            "chat_template": req.chat_template is not None,
            "chat_template_kwargs": is_set(req.chat_template_kwargs),
        },
        "not supported by this server",
    )
    if req.add_generation_prompt is False:
        raise unsupported("add_generation_prompt", "the prompt always ends with the assistant turn")
    if req.service_tier not in _TIERS:
        raise unsupported("service_tier", "only 'auto' and 'default' are supported")
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "only ['text'] is supported")
    if req.verbosity not in (None, "medium"):
        raise unsupported("verbosity", "only 'medium' is supported")
