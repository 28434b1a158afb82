"""Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: each response's
whole conversation (its input, the history it continued, its reply) and the response object as
sent (its JSON), kept in memory for its retention class's lifetime.

A response is visible only under the cache salt it was created with (tenant isolation: with
`--api-key`, a key's responses are invisible to other keys), and the salt is its tenant. Bounded
twice (LRU) by the number of responses and the characters of text they hold: per tenant, so that
one tenant's long chains drop only its own responses, and over all tenants together. Retention
`none` stores nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from deepinfer.server_config import StoredResponseLimits
from deepinfer.text.recipe import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    """One response's conversation: every turn up to and including its reply."""

    messages: tuple[ChatMessage, ...]
    salt: str | None
    expires_s: float
    """Deadline on the store's clock (monotonic seconds)."""
    body: bytes = b""
    """The response object's JSON, as the create call answered it."""

    @property
    def num_chars(self) -> int:
        """What the store's character budgets count: the conversation's text and the bytes of
        the response's JSON."""
        calls = sum(len(c.name) + len(c.arguments) for m in self.messages for c in m.tool_calls)
        return (
            len(self.body) + calls + sum(len(m.content) + len(m.name or "") for m in self.messages)
        )


@dataclass
class _Tenant:
    """One tenant's stored responses, least recently used first."""

    response_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    num_chars: int = 0


class ResponseStore:
    """An LRU map response id -> `StoredResponse`, with an LRU order per tenant (salt) too;
    expired entries are dropped on access."""

    def __init__(
        self,
        lifetimes_s: Mapping[str, float],
        default_retention: str,
        *,
        limits: StoredResponseLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lifetimes_s = dict(lifetimes_s)
        self._default_retention = default_retention
        self._limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._tenants: dict[str | None, _Tenant] = {}
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def num_stored(self, salt: str | None) -> int:
        """Responses the tenant `salt` has stored."""
        tenant = self._tenants.get(salt)
        return 0 if tenant is None else len(tenant.response_ids)

    def lifetime_s(self, retention: str | None) -> float | None:
        """How long a response of this retention class is kept; None: not kept (`none`)."""
        return self._lifetimes_s.get(retention or self._default_retention)

    def put(
        self,
        response_id: str,
        messages: tuple[ChatMessage, ...],
        *,
        salt: str | None,
        retention: str | None,
        body: bytes = b"",
    ) -> bool:
        """Keep `messages` (and the response's JSON `body`) under `response_id`; False when the retention class keeps nothing or
        the conversation alone exceeds a tenant's character budget. Drops the tenant's own least
        recently used responses past its bounds, then anyone's past the global bounds."""
        lifetime_s = self.lifetime_s(retention)
        if lifetime_s is None:
            return False
        limits = self._limits
        entry = StoredResponse(messages, salt, self._clock() + lifetime_s, body)
        if entry.num_chars > min(limits.max_stored_chars, limits.max_stored_chars_per_tenant):
            return False
        self._drop(response_id)
        self._add(response_id, entry)
        tenant = self._tenants[salt]
        while (
            len(tenant.response_ids) > limits.max_stored_responses_per_tenant
            or tenant.num_chars > limits.max_stored_chars_per_tenant
        ):
            self._drop(next(iter(tenant.response_ids)))
        while (
            len(self._entries) > limits.max_stored_responses
            or self._num_chars > limits.max_stored_chars
        ):
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, salt: str | None) -> StoredResponse | None:
        """The stored response if it exists, has not expired and belongs to `salt`."""
        entry = self._entries.get(response_id)
        if entry is None or entry.salt != salt:
            return None
        if entry.expires_s <= self._clock():
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        self._tenants[salt].response_ids.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, salt: str | None) -> bool:
        """Drop the response if `get` would find it; False if it would not."""
        if self.get(response_id, salt) is None:
            return False
        self._drop(response_id)
        return True

    def _add(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._num_chars += entry.num_chars
        tenant = self._tenants.setdefault(entry.salt, _Tenant())
        tenant.response_ids[response_id] = None
        tenant.num_chars += entry.num_chars

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self._num_chars -= entry.num_chars
        tenant = self._tenants[entry.salt]
        del tenant.response_ids[response_id]
        tenant.num_chars -= entry.num_chars
        if not tenant.response_ids:
            del self._tenants[entry.salt]

    def check_integrity(self) -> None:
        limits = self._limits
        assert len(self._entries) <= limits.max_stored_responses
        assert self._num_chars == sum(e.num_chars for e in self._entries.values())
        assert self._num_chars <= limits.max_stored_chars
        assert sum(len(t.response_ids) for t in self._tenants.values()) == len(self._entries)
        for salt, tenant in self._tenants.items():
            assert tenant.response_ids, "an empty tenant is kept"
            entries = [self._entries[i] for i in tenant.response_ids]
            assert all(e.salt == salt for e in entries)
            assert tenant.num_chars == sum(e.num_chars for e in entries)
            assert len(tenant.response_ids) <= limits.max_stored_responses_per_tenant
            assert tenant.num_chars <= limits.max_stored_chars_per_tenant
