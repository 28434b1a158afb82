"""Reading request bodies: a size limit enforced while reading, and msgspec decoding whose
errors name the offending field."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from starlette.requests import Request

from deepinfer.api.errors import ApiError, ErrorKind

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The whole body, or 413 as soon as Content-Length or the bytes read exceed the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(ErrorKind.INVALID_REQUEST, "Content-Length is not a number")
        if int(declared) > max_body_bytes:
            raise _too_large(max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        ErrorKind.TOO_LARGE,
        f"request body exceeds the limit of {max_body_bytes} bytes",
        code="request_too_large",
    )


def decode_json(body: bytes, type_: type[T]) -> T:
    """Decode and type-check a JSON body; errors become 400 naming the field (e.g. `messages[0].role`)."""
    if not body.strip():
        raise ApiError(ErrorKind.INVALID_REQUEST, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match.group("path") if match else None
        message = text[: match.start()] if match else text
        if param:
            message = f"{param}: {message}"
        raise ApiError(ErrorKind.INVALID_REQUEST, message, param=param or None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"malformed JSON body: {exc}") from None
