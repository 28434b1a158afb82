"""Cache salts (adversarial): a salt written in a body can never equal one derived from an API
key, so no client can read the prefixes cached for a key it does not hold."""

from __future__ import annotations

import hashlib
import random

import pytest
from starlette.requests import Request

from deepinfer.api.http.cache_options import cache_options


def request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def salt_of(headers: dict[str, str], body_salt: str | None) -> str | None:
    return cache_options(request(headers), body_salt, None).salt


def test_a_body_cannot_spell_a_key_derived_salt() -> None:
    """Without --api-key a presented key still isolates its holder: copying the salt it
    derives (as the old `key:<digest>|<salt>` form) into a body gives another salt."""
    for body_salt in (None, "", "team-a"):
        keyed = salt_of({"x-api-key": "secret"}, body_salt)
        digest = hashlib.sha256(b"secret").hexdigest()[:32]
        assert keyed is not None and digest in keyed
        for forged in (keyed, f"key:{digest}|{body_salt or ''}", keyed.split(":", 1)[1]):
            assert salt_of({}, forged) != keyed
            assert salt_of({"authorization": "Bearer other"}, forged) != keyed


def test_salt_domains_never_meet_on_random_inputs() -> None:
    rng = random.Random(0)
    pieces = ["key:", "user:", "|", ":", "secret", "a", "", "0" * 32]
    keyed: set[str | None] = set()
    unkeyed: set[str | None] = set()
    for _ in range(3000):
        key = "".join(rng.choices(pieces, k=rng.randint(1, 3)))
        salt = "".join(rng.choices(pieces, k=rng.randint(0, 4)))
        keyed.add(salt_of({"x-api-key": key}, salt) if key else None)
        unkeyed.add(salt_of({}, salt))
        unkeyed.add(salt_of({}, salt_of({"x-api-key": key or "k"}, salt)))
    keyed.discard(None)
    assert keyed and unkeyed and not keyed & unkeyed


@pytest.mark.parametrize("body_salt", ["tenant-1", ""])
def test_same_inputs_same_salt_and_none_without_any(body_salt: str) -> None:
    assert salt_of({}, body_salt) == salt_of({}, body_salt) is not None
    assert salt_of({"x-api-key": "k"}, body_salt) == salt_of(
        {"authorization": "Bearer k"}, body_salt
    )
    assert salt_of({"x-api-key": "k"}, body_salt) != salt_of({"x-api-key": "j"}, body_salt)
    assert salt_of({}, None) is None
