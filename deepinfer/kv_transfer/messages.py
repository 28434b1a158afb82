"""The side channel's messages (msgpack over ZMQ): a consumer's handshake with a producer, and
its release of the blocks the producer kept for it."""

from __future__ import annotations

import msgspec

from deepinfer.kv_transfer.regions import KVRegions


class Hello(msgspec.Struct, tag="hello"):
    """Consumer -> producer: who are you, and where is your KV."""


class Welcome(msgspec.Struct, tag="welcome"):
    engine_id: str
    fingerprint: str
    """The model fingerprint (weights, numerics, KV layout): blocks move only between equals."""
    block_size: int
    agent_metadata: bytes
    """The producer's NIXL agent metadata (`add_remote_agent`)."""
    regions: KVRegions


class Release(msgspec.Struct, tag="release"):
    """Consumer -> producer, after its pull: the blocks kept for this request may go."""

    request_id: str


class Released(msgspec.Struct, tag="released"):
    held: bool
    """The blocks were still kept when the release came, so the pull read them intact (False:
    the hold had expired and the blocks may have been reused: the pull is discarded)."""


Request = Hello | Release
Reply = Welcome | Released

ENCODER = msgspec.msgpack.Encoder()
REQUESTS = msgspec.msgpack.Decoder(Request)
REPLIES = msgspec.msgpack.Decoder(Reply)
