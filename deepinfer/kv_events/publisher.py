"""`KVEventPublisher`: KV events on a ZMQ PUB socket, with a ROUTER socket for replay, as vLLM's
`ZmqEventPublisher` speaks them (so its consumers read us unchanged).

- PUB: one multipart message per batch: (topic, sequence number as 8 bytes big-endian,
  msgpack payload of a `KVEventBatch`). Sequence numbers start at 0 and have no gaps; the first
  batch is `AllBlocksCleared`. A slow or absent subscriber costs messages past the high-water
  mark (dropped by ZMQ), never a wait.
- ROUTER (replay): a request frame holding a start sequence number (8 bytes big-endian) gets
  every kept batch from there as (topic, sequence, payload), then the end marker
  (b"", -1 as 8 signed bytes, b""). The last `buffer_steps` batches are kept.

One thread owns both sockets (ZMQ sockets are not thread-safe): it wakes when a step ends
(`end_step`, which cuts what the step recorded into one batch: a list swap under a lock) or
every 50 ms, encodes and sends the batches cut, and answers replay requests. Events recorded
between steps (the disk tier's writer) go out with the next step's batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from deepinfer.kv_events.recorder import KVEventRecorder
from deepinfer.kv_events.wire import Event, KVEventBatch

log = logging.getLogger("deepinfer.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def _binds(endpoint: str) -> bool:
    """Bind wildcard, ipc and inproc endpoints; connect to the rest (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(
        self,
        recorder: KVEventRecorder,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        """Open the sockets (raising `zmq.ZMQError` if an address is taken) and start the
        thread, after recording `AllBlocksCleared` as the first batch."""
        self.recorder = recorder
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._wake = threading.Event()
        self._cut_lock = threading.Lock()
        self._batches: deque[list[Event]] = deque()
        """Batches cut and not yet sent (bounded by the recorder's own bound between cuts)."""
        self._stopping = False
        self.num_batches = 0
        recorder.cleared()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.end_step()

    def end_step(self) -> None:
        """A step ended: what it recorded becomes one batch, sent on the publisher's thread."""
        self._cut()
        self._wake.set()

    def _cut(self) -> None:
        """Close the batch being recorded (empty ones are not sent)."""
        with self._cut_lock:
            events = self.recorder.take()
            if events:
                self._batches.append(events)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is recorded, stop the thread and close the sockets."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            self._wake.wait(_POLL_S)
            self._wake.clear()
            stopping = self._stopping
            try:
                self._serve_replay()
                if stopping:
                    self._cut()
                while self._batches:
                    self._send(self._batches.popleft())
            except Exception:  # the publisher must outlive anything that goes wrong
                log.exception("publishing KV events failed")
            if stopping:
                return

    def _send(self, events: list[Event]) -> None:
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self._rank))
        self._buffer.append((seq, payload))
        self.num_batches += 1
        # No peer can take it now (a connecting PUB): dropped here, still replayable.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def _serve_replay(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV events replay request")
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
