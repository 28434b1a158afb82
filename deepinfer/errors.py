"""Named errors. Each carries an actionable message; the API layer maps them to status codes."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says which and how to fix it."""


class DeepInferError(Exception):
    """Base of every error deepinfer raises on purpose."""


class InvalidRequestError(DeepInferError):
    """The caller sent something we cannot serve (a bad parameter, a too-long prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus max_tokens exceed the context window."""

    def __init__(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        *,
        message: str | None = None,
        param: str = "max_tokens",
    ) -> None:
        super().__init__(
            message
            or f"this model's context is {max_model_len} tokens, but the request asks for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} prompt + {max_tokens} max_tokens); "
            "shorten the prompt or lower max_tokens",
            param=param,
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class PromptTooLongError(ContextLengthError):
    """A prompt refused before it was tokenized: its size alone proves it needs at least
    `num_prompt_tokens` tokens, more than the context holds."""

    def __init__(self, min_prompt_tokens: int, max_model_len: int, param: str) -> None:
        super().__init__(
            min_prompt_tokens,
            0,
            max_model_len,
            message=f"this model's context is {max_model_len} tokens, but the prompt is at "
            f"least {min_prompt_tokens} tokens long; shorten the prompt",
            param=param,
        )


class OverloadedError(DeepInferError):
    """The waiting queue is full; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(DeepInferError):
    """The model file is missing, corrupt, or of an unsupported architecture."""


class EngineDeadError(DeepInferError):
    """The engine loop stopped (after an internal error or shutdown); no more requests."""


class RequestFailedError(DeepInferError):
    """An internal error stopped this request (a step holding it failed); the engine serves on."""


class FatalEngineError(DeepInferError):
    """The engine cannot go on (the device is lost, or its state is inconsistent after a failed
    step): it stops, and reports this as its reason."""
