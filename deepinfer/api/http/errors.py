"""API errors and their two wire envelopes (OpenAI and Anthropic).

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Refusing fields the server does not honour: a 400 naming the field, never a silent no-op.

Each API declares the fields it accepts but does not honour, and refuses a request that sets one
to anything but its default (`docs/api.md` lists every field and what the server does with it).
"""

from __future__ import annotations

import enum
import logging

import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from deepinfer.errors import (
    ContextLengthError,
    DeepInferError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
)

log = logging.getLogger("deepinfer.api")


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    CLIENT_GONE = "client_gone"


# kind -> (OpenAI status, OpenAI type, Anthropic status, Anthropic type)
_WIRE: dict[ErrorKind, tuple[int, str, int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", 400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "authentication_error", 401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error", 404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error", 405, "invalid_request_error"),
    ErrorKind.TOO_LARGE: (413, "invalid_request_error", 413, "request_too_large"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error", 529, "overloaded_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", 503, "api_error"),
    ErrorKind.INTERNAL: (500, "internal_error", 500, "api_error"),
    # The client left mid-request: answered to nobody, logged as 499 (nginx's "client closed").
    ErrorKind.CLIENT_GONE: (499, "client_closed_request", 499, "client_closed_request"),
}


class ApiError(Exception):
    """An error answered to the client; `param` names the offending field when there is one."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def openai_status(self) -> int:
        return _WIRE[self.kind][0]

    @property
    def anthropic_status(self) -> int:
        return _WIRE[self.kind][2]


class _OpenAIErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: _OpenAIErrorBody


class _AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag_field="type", tag="error"):
    error: _AnthropicErrorBody


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception to the error the client sees (internal details are logged, not sent)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthError):
        return ApiError(
            ErrorKind.INVALID_REQUEST, exc.message, param=exc.param, code="context_length_exceeded"
        )
    if isinstance(exc, InvalidRequestError):
        return ApiError(ErrorKind.INVALID_REQUEST, exc.message, param=exc.param)
    if isinstance(exc, OverloadedError):
        return ApiError(ErrorKind.OVERLOADED, str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        return ApiError(ErrorKind.UNAVAILABLE, f"the engine is not running: {exc}")
    if isinstance(exc, DeepInferError):
        return ApiError(ErrorKind.INTERNAL, str(exc))
    if isinstance(exc, ClientDisconnect):  # logged where the body is read (`body_timeout.py`)
        return ApiError(ErrorKind.CLIENT_GONE, "the client disconnected mid-request")
    log.error("internal error", exc_info=exc)
    return ApiError(ErrorKind.INTERNAL, "internal server error")


def openai_payload(err: ApiError) -> OpenAIError:
    return OpenAIError(_OpenAIErrorBody(err.message, _WIRE[err.kind][1], err.param, err.code))


def anthropic_payload(err: ApiError) -> AnthropicError:
    message = err.message
    if err.param is not None and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return AnthropicError(_AnthropicErrorBody(_WIRE[err.kind][3], message))


def _headers(err: ApiError) -> dict[str, str]:
    return {} if err.retry_after_s is None else {"retry-after": str(err.retry_after_s)}


def openai_error_response(exc: BaseException) -> Response:
    err = to_api_error(exc)
    body = msgspec.json.encode(openai_payload(err))
    return Response(body, err.openai_status, _headers(err), media_type="application/json")


def anthropic_error_response(exc: BaseException) -> Response:
    err = to_api_error(exc)
    body = msgspec.json.encode(anthropic_payload(err))
    return Response(body, err.anthropic_status, _headers(err), media_type="application/json")


def is_anthropic_path(route_path: str) -> bool:
    """Anthropic routes answer in Anthropic's envelope; everything else in OpenAI's."""
    return route_path.startswith("/v1/messages")


def error_response_for(route_path: str, exc: BaseException) -> Response:
    if is_anthropic_path(route_path):
        return anthropic_error_response(exc)
    return openai_error_response(exc)


def unsupported(param: str, why: str) -> ApiError:
    """`<param>: <why>` as a 400 whose `param` names the field."""
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {why}", param=param)


def is_set(raw: msgspec.Raw) -> bool:
    """A raw field present with a value other than null."""
    return len(raw) > 0 and bytes(raw).strip() != b"null"


def refuse_set(fields: dict[str, bool], why: str) -> None:
    """Refuse the first field (in order) whose flag says it is set to a non-default value."""
    for param, set_ in fields.items():
        if set_:
            raise unsupported(param, why)
