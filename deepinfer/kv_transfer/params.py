"""`KVTransferParams`: vLLM's `kv_transfer_params` request and response field.

The names are vLLM's NixlConnector's, so routers that copy the field from a prefill answer into
a decode request (`vllm-router`'s PD mode) need nothing of ours. `remote_request_id` and
`remote_last_block_hash` are this engine's: the producer's hold, and the chained hash of the last
block it keeps (equal on the consumer only when both ran the same tokens, salt and model).
"""

from __future__ import annotations

import msgspec

from deepinfer.errors import InvalidRequestError


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    do_remote_decode: bool = False
    """Sent to a producer: keep the prompt's blocks for a consumer to pull."""
    do_remote_prefill: bool = False
    """Sent to a consumer (copied from the producer's answer): pull the prompt's blocks."""
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    """The producer's block ids of the prompt's leading full blocks, in order."""
    remote_host: str | None = None
    remote_port: int | None = None
    """The producer's side channel (handshake, release)."""
    remote_request_id: str | None = None
    remote_last_block_hash: str | None = None
    """Hex of the chained hash of the last block in `remote_block_ids`."""
    tp_size: int = 1

    @property
    def pullable(self) -> bool:
        """Names blocks on a reachable producer."""
        return bool(
            self.do_remote_prefill
            and self.remote_block_ids
            and self.remote_host
            and self.remote_port
            and self.remote_request_id
            and self.remote_last_block_hash
        )


_DECODER = msgspec.json.Decoder(KVTransferParams | None)


def parse_params(raw: msgspec.Raw) -> KVTransferParams | None:
    """The request's `kv_transfer_params` (None when absent or null); a malformed one is a 400."""
    if not raw:
        return None
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(
            f"kv_transfer_params: {exc}", param="kv_transfer_params"
        ) from None
