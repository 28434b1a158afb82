"""Stored responses, for `previous_response_id`: each response's whole conversation (its input,
the history it continued, its reply), kept in memory for its retention class's lifetime.

Bounded twice (LRU): by the number of responses and by the characters of text they hold. A
response is visible only under the cache salt it was created with (tenant isolation: with
`--api-key`, a key's responses are invisible to other keys). Retention `none` stores nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deepinfer.text.recipe import ChatMessage

MAX_RESPONSES = 4096
MAX_STORED_CHARS = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """One response's conversation: every turn up to and including its reply."""

    messages: tuple[ChatMessage, ...]
    salt: str | None
    expires_s: float
    """Deadline on the store's clock (monotonic seconds)."""

    @property
    def num_chars(self) -> int:
        calls = sum(len(c.name) + len(c.arguments) for m in self.messages for c in m.tool_calls)
        return calls + sum(len(m.content) + len(m.name or "") for m in self.messages)


class ResponseStore:
    """An LRU map response id -> `StoredResponse`, expired entries dropped on access."""

    def __init__(
        self,
        lifetimes_s: Mapping[str, float],
        default_retention: str,
        *,
        max_responses: int = MAX_RESPONSES,
        max_chars: int = MAX_STORED_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lifetimes_s = dict(lifetimes_s)
        self._default_retention = default_retention
        self._max_responses, self._max_chars = max_responses, max_chars
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

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
    ) -> bool:
        """Keep `messages` under `response_id`; False when the retention class keeps nothing or
        the conversation alone exceeds the store's character budget."""
        lifetime_s = self.lifetime_s(retention)
        if lifetime_s is None:
            return False
        entry = StoredResponse(messages, salt, self._clock() + lifetime_s)
        if entry.num_chars > self._max_chars:
            return False
        self._drop(response_id)
        self._entries[response_id] = entry
        self._num_chars += entry.num_chars
        while len(self._entries) > self._max_responses or self._num_chars > self._max_chars:
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
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._num_chars -= entry.num_chars

    def check_integrity(self) -> None:
        assert len(self._entries) <= self._max_responses
        assert self._num_chars == sum(e.num_chars for e in self._entries.values())
        assert self._num_chars <= self._max_chars
