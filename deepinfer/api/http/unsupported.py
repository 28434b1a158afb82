"""Refusing fields the server does not honour: a 400 naming the field, never a silent no-op.

Each API declares the fields it accepts but does not honour, and refuses a request that sets one
to anything but its default (`docs/api.md` lists every field and what the server does with it).
"""

from __future__ import annotations

import msgspec

from deepinfer.api.http.errors import ApiError, ErrorKind


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
