"""`TransferAgent`: this replica's NIXL agent over its KV pool (NIXL with its UCX backend: TCP
or shared memory between CPU processes, RDMA or NVLink where present). NIXL is imported here
only, when `--kv-transfer nixl` asks for it."""

from __future__ import annotations

import threading
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
    """NIXL's own progress thread is off: it spins a core whole whether or not anything moves
    (measured: 1.0 core idle, against none without it). A consumer's reads progress as it polls
    them; a producer calls `progress` while it keeps blocks for consumers (transports that need
    the target's help, TCP among them, move bytes only then). Every call holds one lock (the
    agent is made without NIXL's own locking)."""

    def __init__(self, name: str, caches: KVCaches) -> None:
        api = _nixl()
        self.name = name
        self._lock = threading.Lock()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        self.regions: KVRegions = kv_regions(caches)
        self._registered = self._agent.register_memory(region_tensors(caches))

    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def progress(self) -> None:
        """Let NIXL move what it has in flight (notifications it brings are not used)."""
        with self._lock:
            self._agent.get_new_notifs()

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._agent.remove_remote_agent(name)

    def start_read(
        self,
        local_ids: Sequence[int],
        remote: str,
        remote_regions: KVRegions,
        remote_ids: Sequence[int],
    ) -> Handle:
        """Post a read of `remote_ids` of every region of `remote` into `local_ids` of ours."""
        with self._lock:
            return self._start_read(local_ids, remote, remote_regions, remote_ids)

    def _start_read(
        self,
        local_ids: Sequence[int],
        remote: str,
        remote_regions: KVRegions,
        remote_ids: Sequence[int],
    ) -> Handle:
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
            self._release(handle)
            raise TransferError(f"NIXL refused the read: {state}")
        return handle

    def state(self, handle: Handle) -> str:
        """`PROC`, `DONE` or `ERR` (asking moves the transfer on)."""
        with self._lock:
            try:
                return str(self._agent.check_xfer_state(handle))
            except Exception:
                return "ERR"

    def release(self, handle: Handle) -> bool:
        """Free a handle; False if NIXL could not (a read it could not stop)."""
        with self._lock:
            return self._release(handle)

    def _release(self, handle: Handle) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._agent.deregister_memory(self._registered)
