"""Connection hygiene: a connection that stops making progress is closed.

- Heads: a whole request head must arrive within `header_timeout_s` of the connection opening or
  of its previous response. uvicorn has no such deadline (its keep-alive timer covers only the
  idle gap, and any byte cancels it), so `http_protocol` returns uvicorn's HTTP protocol with one
  added: a timer armed while the protocol waits for a head and disarmed when the head is whole.
- Bodies: `body_timeout.BodyTimeoutMiddleware` (part of the app, so a mounted app has it too)
  answers 408 and closes the connection when a request body stalls between two reads or arrives
  slower than its minimum rate.
- Shares: beyond the connection cap, one client address cannot hold every connection: each
  protocol registers with the server's `connection_shares.ConnectionShares`, which names the
  stalled connections of the addresses over their share to close (`connection_shares.py`).

`ConnectionShares`: the open connections by client address, and which to close when they
exceed the connection cap, so that one address cannot hold every connection.

The rule: while more connections are open than the cap and more than one address holds some,
stalled connections (waiting for a request head, idle between requests, or partway through a
request body) of the addresses holding more than an equal share (cap / addresses) are closed,
the largest holder first and its oldest connection first, until the count is back at the cap. A
connection serving a whole request is never closed, and a lone address keeps the whole cap (its
requests beyond it get the server's 503, as without this rule).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from typing import Any, Protocol, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("deepinfer.api")

_DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeadDeadline:
    """One connection's deadline for a whole request head; on expiry its transport is closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, transport: asyncio.BaseTransport) -> None:
        """Start the clock unless it runs already: bytes trickling in do not restart it."""
        if self._handle is None:
            self._handle = self._loop.call_later(self._timeout_s, _close_stalled, transport)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _close_stalled(transport: asyncio.BaseTransport) -> None:
    if not transport.is_closing():
        log.debug("closing a connection that sent no whole request head in time")
        transport.close()


def _client_key(client: tuple[str, int] | None) -> str:
    """The client's address without its port (a Unix socket's peers are one client)."""
    return client[0] if client else ""


class _Cycle(Protocol):
    """The fields read of uvicorn's `RequestResponseCycle` (the same in h11 and httptools)."""

    response_complete: bool
    more_body: bool


def _is_stalled(cycle: _Cycle | None) -> bool:
    """True unless the connection's latest request is whole and its response unfinished: the
    cycle is None before the first request, `response_complete` between requests, `more_body`
    while the body is arriving."""
    return cycle is None or cycle.response_complete or cycle.more_body


def _evict(transport: asyncio.Transport, client_key: str, max_connections: int) -> None:
    log.debug(
        "closing a stalled connection of %s: beyond the cap of %d connections, it holds more "
        "than its share",
        client_key or "a local client",
        max_connections,
    )
    transport.abort()  # it owes the server bytes; whatever it has not read is dropped too


class _SharedConnection:
    """What `ConnectionShares` asks of a connection, for both of uvicorn's HTTP protocols."""

    client: tuple[str, int] | None
    cycle: Any
    transport: asyncio.Transport
    shares: ConnectionShares  # one per server, set by `http_protocol`

    @property
    def client_key(self) -> str:
        return _client_key(self.client)

    def is_stalled(self) -> bool:
        return _is_stalled(self.cycle)

    def evict(self) -> None:
        _evict(self.transport, self.client_key, self.shares.max_connections)


class H11HeadTimeoutProtocol(_SharedConnection, H11Protocol):
    """uvicorn's h11 protocol with a head deadline, armed while the client's side is IDLE: h11
    returns there only when the connection opens and when a request and its response are both
    done, and leaves it as soon as a whole head is parsed."""

    header_timeout_s: float = _DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.head_deadline = HeadDeadline(self.loop, self.header_timeout_s)
        super().connection_made(transport)
        self._sync_head_deadline()
        for conn in self.shares.open(self):
            conn.evict()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_deadline.disarm()
        self.shares.close(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_head_deadline()

    def _sync_head_deadline(self) -> None:
        if self.conn.their_state is h11.IDLE:
            self.head_deadline.arm(self.transport)
        else:
            self.head_deadline.disarm()


@functools.cache
def httptools_protocol() -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with a head deadline, or None without httptools. Armed when
    the connection opens and when a response completes with no pipelined request queued;
    disarmed when the parser reports a whole head."""
    try:
        import httptools  # noqa: F401  (a dependency: uvicorn's protocol below parses with it)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HttpToolsHeadTimeoutProtocol(_SharedConnection, HttpToolsProtocol):
        header_timeout_s: float = _DEFAULT_HEADER_TIMEOUT_S

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.head_deadline = HeadDeadline(self.loop, self.header_timeout_s)
            super().connection_made(transport)
            self.head_deadline.arm(transport)
            for conn in self.shares.open(self):
                conn.evict()

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_deadline.disarm()
            self.shares.close(self)
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self.head_deadline.disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            if not self.pipeline and not self.transport.is_closing():
                self.head_deadline.arm(self.transport)
            super().on_response_complete()

    return HttpToolsHeadTimeoutProtocol


def http_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """The HTTP protocol for uvicorn's `http=`: httptools (a dependency: C, where h11 is pure
    Python, on the event loop's path of every streamed token), else h11 where it is missing;
    either with a head deadline of `header_timeout_s` and its own `ConnectionShares` of
    `max_connections` (call once per server: the class holds that server's connections)."""
    base = httptools_protocol() or H11HeadTimeoutProtocol
    namespace = {
        "header_timeout_s": header_timeout_s,
        "shares": ConnectionShares(max_connections),
    }
    return cast(type[asyncio.Protocol], type(base.__name__, (base,), namespace))


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
