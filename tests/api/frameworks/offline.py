"""A guard that refuses (and records) every network connection except to loopback, to show that
a framework needs no network at import or run."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOOPBACK_HOSTS = frozenset({None, "localhost", "127.0.0.1", "::1", b"localhost", b"127.0.0.1"})


class Offline:
    """Patches name resolution and `connect` while active; `attempts` lists what was refused."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def _refuse(self, target: str) -> OSError:
        self.attempts.append(target)
        return OSError(f"network access refused in tests: {target}")

    @contextmanager
    def active(self) -> Iterator[Offline]:
        getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

        def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            if host not in LOOPBACK_HOSTS:
                raise self._refuse(f"resolve {host!r}")
            return getaddrinfo(host, *args, **kwargs)

        def guarded_connect(sock: socket.socket, address: Any) -> None:
            host = address[0] if isinstance(address, tuple) else None
            if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in LOOPBACK_HOSTS:
                raise self._refuse(f"connect {address!r}")
            connect(sock, address)

        socket.getaddrinfo = guarded_getaddrinfo
        socket.socket.connect = guarded_connect  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect  # type: ignore[method-assign]
