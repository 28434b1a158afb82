"""`TransferAgent`: this replica's NIXL agent over its KV pool (NIXL with its UCX backend: TCP
or shared memory between CPU processes, RDMA or NVLink where present). NIXL is imported here
only, when `--kv-transfer nixl` asks for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer.errors import ConfigError
from deepinfer.kv_transfer.regions import KVRegions, kv_regions, region_tensors, runs
from deepinfer.model.kv_layout import KVCaches

Handle = Any
"""A NIXL transfer handle."""


class TransferError(RuntimeError):
    """NIXL failed to start a transfer."""


def _nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise ConfigError(f"--kv-transfer nixl needs NIXL: pip install nixl ({exc})") from None
    return _api


class TransferAgent:
    def __init__(self, name: str, caches: KVCaches) -> None:
        api = _nixl()
        self.name = name
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self.regions: KVRegions = kv_regions(caches)
        self._registered = self._agent.register_memory(region_tensors(caches))

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def start_read(
        self,
        local_ids: Sequence[int],
        remote: str,
        remote_regions: KVRegions,
        remote_ids: Sequence[int],
    ) -> Handle:
        """Post a read of `remote_ids` of every region of `remote` into `local_ids` of ours."""
        local_starts, remote_starts, lengths = runs(local_ids, remote_ids)
        local = self._agent.get_xfer_descs(
            self.regions.descriptors(local_starts, lengths), self.regions.memory
        )
        far = self._agent.get_xfer_descs(
            remote_regions.descriptors(remote_starts, lengths), remote_regions.memory
        )
        try:  # NIXL's errors (a remote disconnected, ...) are its own classes
            handle = self._agent.initialize_xfer("READ", local, far, remote)
        except Exception as exc:
            raise TransferError(f"NIXL could not set up the read: {exc!r}") from exc
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            state = repr(exc)
        if state not in ("DONE", "PROC"):
            self.release(handle)
            raise TransferError(f"NIXL refused the read: {state}")
        return handle

    def state(self, handle: Handle) -> str:
        """`PROC`, `DONE` or `ERR`."""
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def release(self, handle: Handle) -> bool:
        """Free a handle; False if NIXL could not (a read it could not stop)."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)
