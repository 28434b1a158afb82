"""`ConnectionShares`: the open connections by client address, and which to close when they
exceed the connection cap, so that one address cannot hold every connection.

The rule: while more connections are open than the cap and more than one address holds some,
stalled connections (waiting for a request head, idle between requests, or partway through a
request body) of the addresses holding more than an equal share (cap / addresses) are closed,
the largest holder first and its oldest connection first, until the count is back at the cap. A
connection serving a whole request is never closed, and a lone address keeps the whole cap (its
requests beyond it get the server's 503, as without this rule).
"""

from __future__ import annotations

import itertools
from typing import Protocol


class SharedConnection(Protocol):
    """What the shares need of a connection (uvicorn's protocols in `connections.py`)."""

    @property
    def client_key(self) -> str:
        """The address the connection comes from: connections sharing it are one client."""
        ...

    def is_stalled(self) -> bool:
        """True while the client owes the server bytes: a request head or the rest of a body,
        or nothing at all between requests."""
        ...

    def evict(self) -> None:
        """Close the connection at once (it was uncounted already)."""
        ...


class ConnectionShares:
    """Open connections grouped by `client_key`, each group in opening order. Invariant: every
    open connection is in exactly one group, no group is empty, `num_open` counts them all."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._by_client: dict[str, dict[SharedConnection, None]] = {}
        self.num_open = 0

    def open(self, conn: SharedConnection) -> list[SharedConnection]:
        """Count `conn` as open; returns the connections to `evict` now (uncounted already; it
        may be `conn` itself)."""
        self._by_client.setdefault(conn.client_key, {})[conn] = None
        self.num_open += 1
        if self.num_open <= self.max_connections or len(self._by_client) < 2:
            return []
        return self._take_excess()

    def close(self, conn: SharedConnection) -> None:
        """Uncount `conn`; a connection already uncounted (closed by `open`) is ignored."""
        group = self._by_client.get(conn.client_key)
        if group is None or conn not in group:
            return
        del group[conn]
        self.num_open -= 1
        if not group:
            del self._by_client[conn.client_key]

    def num_held(self, client_key: str) -> int:
        return len(self._by_client.get(client_key, ()))

    def _take_excess(self) -> list[SharedConnection]:
        """Stalled connections of the addresses over an equal share, largest holder first and
        oldest first, until the count is back at the cap (or none is left to take)."""
        share = self.max_connections // len(self._by_client)
        num_wanted = self.num_open - self.max_connections
        taken: list[SharedConnection] = []
        for group in sorted(self._by_client.values(), key=len, reverse=True):
            if len(group) <= share or len(taken) == num_wanted:
                break
            num_taken = min(len(group) - share, num_wanted - len(taken))
            taken += itertools.islice((c for c in group if c.is_stalled()), num_taken)
        for conn in taken:
            self.close(conn)
        return taken

    def check_integrity(self) -> None:
        assert all(self._by_client.values()), "an empty group is kept"
        assert self.num_open == sum(len(g) for g in self._by_client.values())
        for key, group in self._by_client.items():
            assert all(conn.client_key == key for conn in group)
