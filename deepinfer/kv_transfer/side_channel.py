"""The producer's side channel: a ZMQ ROUTER socket on the event loop answering consumers'
handshakes and releases; and the consumer's one-shot request to it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from deepinfer.kv_transfer.messages import (
    ENCODER,
    REPLIES,
    REQUESTS,
    Hello,
    Release,
    Released,
    Reply,
    Welcome,
)

log = logging.getLogger("deepinfer.kv_transfer")


class SideChannel:
    """Serves `Hello` with `welcome()` and `Release` with `release(request_id)`; `tick()` runs
    about once a second (the holds' expiry)."""

    def __init__(
        self,
        host: str,
        port: int,
        welcome: Callable[[], Welcome],
        release: Callable[[str], bool],
        tick: Callable[[], None],
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{host}"
        if port:
            self._socket.bind(f"{address}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(address)
        self._welcome, self._release, self._tick = welcome, release, tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            try:
                ready = await self._socket.poll(1000)
                self._tick()
                if not ready:
                    continue
                frames = await self._socket.recv_multipart()
                reply = self._answer(frames[-1])
                await self._socket.send_multipart([*frames[:-1], ENCODER.encode(reply)])
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad message never stops the channel
                log.exception("KV transfer side channel: a message failed")

    def _answer(self, payload: bytes) -> Reply:
        message = REQUESTS.decode(payload)
        if isinstance(message, Hello):
            return self._welcome()
        return Released(self._release(message.request_id))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close(0)
        self._context.term()


class ChannelError(RuntimeError):
    """The producer did not answer in time, or answered nonsense."""


async def ask(
    context: zmq.asyncio.Context, host: str, port: int, message: Hello | Release, timeout_s: float
) -> Reply:
    """Send one message to a producer's side channel and await its reply. A producer that is
    gone fails at once (a refused TCP connection), not after `timeout_s`: ZMQ itself would keep
    reconnecting in silence."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        raise ChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc
    writer.close()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{host}:{port}")
        await socket.send(ENCODER.encode(message))
        if not await socket.poll(int(timeout_s * 1000)):
            raise ChannelError(f"no answer from {host}:{port} in {timeout_s:g} s")
        return REPLIES.decode(await socket.recv())
    except (zmq.ZMQError, msgspec.DecodeError) as exc:
        raise ChannelError(f"side channel {host}:{port}: {exc}") from exc
    finally:
        socket.close(0)
