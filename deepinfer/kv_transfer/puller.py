"""`KVPuller`: the consumer's side. Before a request with `do_remote_prefill` is queued, the
prompt's leading blocks the producer kept, less those this replica already has cached, are
read over NIXL into reserved free blocks; once the producer confirms it still held them (so the
read saw them intact), they are registered under the prompt's hashes and admission finds them as
prefix hits. Anything else (no answer, another model, a read that fails or takes too long, a
hold that expired) registers nothing: the request computes its prompt itself."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq.asyncio

from deepinfer.cache.block_hash import BlockHash
from deepinfer.kv_transfer.agent import Handle, TransferAgent
from deepinfer.kv_transfer.messages import Hello, Release, Released, Welcome
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.kv_transfer.regions import KVRegions
from deepinfer.kv_transfer.side_channel import ChannelError, ask
from deepinfer.request import Request
from deepinfer.tiers.device_blocks import TierBlocks

log = logging.getLogger("deepinfer.kv_transfer")

POLL_S = (0.0002, 0.005)
"""A read's state is polled from the first to the second interval, doubling."""


@dataclass(frozen=True)
class _Remote:
    agent: str
    regions: KVRegions


@dataclass
class PullStats:
    num_pulls: int = 0
    num_pulled_blocks: int = 0
    num_local_blocks: int = 0
    """Blocks a pull skipped: this replica had them cached."""
    num_failed: int = 0
    num_quarantined_blocks: int = 0
    """Blocks left reserved forever after a read NIXL could not stop."""
    seconds_total: float = 0.0
    """Time pulls took, handshake, read and release included."""


class KVPuller:
    def __init__(
        self,
        agent: TransferAgent,
        blocks: TierBlocks,
        fingerprint: str,
        block_size: int,
        timeout_s: float,
    ) -> None:
        self._agent = agent
        self._blocks = blocks
        self._fingerprint = fingerprint
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._context = zmq.asyncio.Context()
        self._nixl = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-nixl")
        """Every NIXL call of a pull: one at a time, off the loop."""
        self._remotes: dict[str, _Remote] = {}
        self._handshakes: dict[str, asyncio.Lock] = {}
        self.stats = PullStats()

    async def pull(self, request: Request, params: KVTransferParams) -> int:
        """Pull what the producer kept of the prompt; returns the blocks registered."""
        assert params.remote_block_ids is not None
        hashes = self._blocks.prompt_hashes(request)
        remote_ids = params.remote_block_ids[: len(hashes)]
        num = len(remote_ids)
        if not num or hashes[num - 1].hex() != params.remote_last_block_hash:
            log.warning("request %s: the producer ran other tokens; computing the prompt here",
                        request.request_id)  # fmt: skip
            await self._release(params)
            return 0
        num_local = self._blocks.cached_prefix_len(hashes[:num])
        self.stats.num_local_blocks += num_local
        reservation = self._blocks.reserve(num - num_local) if num_local < num else None
        if reservation is None:
            await self._release(params)
            return 0
        reservation_id, block_ids = reservation
        start = time.perf_counter()
        registered: list[BlockHash] = []
        free = True
        """Whether the reserved blocks go back (registered or not) when the pull ends: not
        after a read NIXL could not stop, nor before a read still running has ended."""
        try:
            remote = await self._remote(params)
            reading = self._read(block_ids, remote, remote_ids[num_local:num])
            try:
                read = await asyncio.shield(reading)
            except asyncio.CancelledError:  # the read may still be writing the blocks
                free = False
                reading.add_done_callback(lambda _: self._blocks.commit(reservation_id, []))
                raise
            if read is None:
                free = False
                self.stats.num_quarantined_blocks += len(block_ids)
            if read and await self._release(params):
                registered = hashes[num_local:num]
            elif not read:
                self._forget(params)
                await self._release(params)
        except (ChannelError, RuntimeError, ValueError) as exc:
            log.warning("request %s: KV pull from %s failed (%s); computing the prompt here",
                        request.request_id, params.remote_engine_id, exc)  # fmt: skip
            self._forget(params)
            if not isinstance(exc, ChannelError):  # else it did not answer: its hold expires
                await self._release(params)
        finally:
            if free:
                self._blocks.commit(reservation_id, registered)
        self.stats.seconds_total += time.perf_counter() - start
        self.stats.num_pulls += 1
        self.stats.num_pulled_blocks += len(registered)
        if not registered:
            self.stats.num_failed += 1
        return len(registered)

    async def _remote(self, params: KVTransferParams) -> _Remote:
        engine_id = params.remote_engine_id or ""
        lock = self._handshakes.setdefault(engine_id, asyncio.Lock())
        async with lock:
            remote = self._remotes.get(engine_id)
            if remote is None:
                remote = await self._handshake(params)
                self._remotes[engine_id] = remote
            return remote

    async def _handshake(self, params: KVTransferParams) -> _Remote:
        assert params.remote_host is not None and params.remote_port is not None
        reply = await ask(
            self._context, params.remote_host, params.remote_port, Hello(), self._timeout_s
        )
        if not isinstance(reply, Welcome):
            raise ChannelError(f"expected a welcome, got {type(reply).__name__}")
        if reply.fingerprint != self._fingerprint or reply.block_size != self._block_size:
            raise ValueError("the producer serves another model, numerics or block size")
        if not reply.regions.compatible(self._agent.regions):
            raise ValueError("the producer's KV blocks differ in shape from ours")
        if reply.engine_id != params.remote_engine_id:
            raise ValueError(f"the side channel is engine {reply.engine_id}, not the one named")
        loop = asyncio.get_running_loop()
        name = await loop.run_in_executor(self._nixl, self._agent.add_remote, reply.agent_metadata)
        return _Remote(name, reply.regions)

    def _forget(self, params: KVTransferParams) -> None:
        """Drop a producer's handshake (it may have restarted): the next pull makes a new one."""
        remote = self._remotes.pop(params.remote_engine_id or "", None)
        if remote is not None:
            self._nixl.submit(self._remove, remote.agent)

    def _remove(self, agent: str) -> None:
        try:
            self._agent.remove_remote(agent)
        except Exception:
            log.exception("forgetting NIXL agent %s failed", agent)

    def _read(
        self, block_ids: list[int], remote: _Remote, remote_ids: list[int]
    ) -> asyncio.Future[bool | None]:
        """True: read; False: failed or timed out, stopped; None: NIXL could not stop it (its
        destination blocks must never be used again). On the NIXL thread: UCX moves the bytes
        while the transfer's state is polled, which must not hold up the loop."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._nixl, self._read_blocking, block_ids, remote, remote_ids)

    def _read_blocking(
        self, block_ids: list[int], remote: _Remote, remote_ids: list[int]
    ) -> bool | None:
        handle: Handle = self._agent.start_read(block_ids, remote.agent, remote.regions, remote_ids)
        deadline = time.monotonic() + self._timeout_s
        wait = POLL_S[0]
        while (state := self._agent.state(handle)) == "PROC" and time.monotonic() < deadline:
            time.sleep(wait)
            wait = min(wait * 2, POLL_S[1])
        released = self._agent.release(handle)
        if state == "DONE" and released:
            return True
        log.warning("KV read from %s: %s", remote.agent, "timed out" if state == "PROC" else state)
        return False if released else None

    async def _release(self, params: KVTransferParams) -> bool:
        """Tell the producer its hold may go; True if it still held the blocks."""
        assert params.remote_request_id is not None
        try:
            reply = await ask(
                self._context,
                params.remote_host or "",
                params.remote_port or 0,
                Release(params.remote_request_id),
                self._timeout_s,
            )
        except ChannelError as exc:
            log.warning("releasing %s's hold failed: %s", params.remote_engine_id, exc)
            return False
        return isinstance(reply, Released) and reply.held

    def close(self) -> None:
        self._nixl.shutdown(wait=True)
        self._context.term()
