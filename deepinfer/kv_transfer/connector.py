"""`KVTransfer`: what the engine sees of KV transfers between replicas (`--kv-transfer nixl`).

The engine builder makes one over the prefill pool (its manager and caches); the core calls
`finished` for each request a step finished (a producer keeps its blocks), the async engine
`start`, `pull` on submit (a consumer fetches them) and `params_for` when a request is answered,
then `close`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import KVTransferConfig
from deepinfer.kv_transfer.agent import TransferAgent
from deepinfer.kv_transfer.holds import KVHolds
from deepinfer.kv_transfer.messages import Welcome
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.kv_transfer.puller import KVPuller, PullStats
from deepinfer.kv_transfer.side_channel import SideChannel
from deepinfer.kv_transfer.stats import KVTransferStats
from deepinfer.model.kv_layout import KVCaches
from deepinfer.request import FinishReason, Request
from deepinfer.tiers.device_blocks import TierBlocks

PROGRESS_S = 0.0002
"""Between two progress calls while blocks are kept."""
IDLE_S = 0.05
"""How soon a hold is noticed when none was kept."""


class KVTransfer:
    def __init__(
        self, config: KVTransferConfig, kv: KVCacheManager, caches: KVCaches, fingerprint: str
    ) -> None:
        self.config = config
        self.engine_id = f"deepinfer-{uuid.uuid4().hex[:16]}"
        """New at every start: a consumer never reuses a restarted producer's handshake."""
        self._fingerprint = fingerprint
        self._block_size = kv.block_size
        blocks = TierBlocks(kv)
        self._agent = TransferAgent(self.engine_id, caches)
        role = config.kv_role
        self.holds = KVHolds(blocks, config.kv_transfer_hold_s) if role != "consumer" else None
        self._puller = (
            KVPuller(self._agent, blocks, fingerprint, kv.block_size, config.kv_transfer_timeout_s)
            if role != "producer"
            else None
        )
        self._channel: SideChannel | None = None
        self._stopping = threading.Event()
        self._progress: threading.Thread | None = None

    @property
    def produces(self) -> bool:
        return self.holds is not None

    @property
    def consumes(self) -> bool:
        return self._puller is not None

    async def start(self) -> None:
        """Open the side channel (producers), on the running loop."""
        if self.holds is not None and self._channel is None:
            holds = self.holds
            self._channel = SideChannel(
                self.config.kv_transfer_host,
                self.config.kv_transfer_port,
                self._welcome,
                holds.release,
                holds.expire,
            )
            self._channel.start()
            self._progress = threading.Thread(
                target=self._progress_while_holding, name="deepinfer-nixl-progress", daemon=True
            )
            self._progress.start()

    def _progress_while_holding(self) -> None:
        """While blocks are kept for consumers, let NIXL progress (their reads may need this
        side's help); idle otherwise."""
        holds = self.holds
        assert holds is not None
        while not self._stopping.is_set():
            if holds.num_holds:
                self._agent.progress()
                time.sleep(PROGRESS_S)
            else:
                self._stopping.wait(IDLE_S)

    def _welcome(self) -> Welcome:
        return Welcome(
            self.engine_id,
            self._fingerprint,
            self._block_size,
            self._agent.metadata(),
            self._agent.regions,
        )

    def finished(self, request: Request) -> None:
        """A step finished `request`: keep its prompt's blocks if a consumer will pull them."""
        if (
            request.hold_kv
            and self.holds is not None
            and request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        ):
            self.holds.hold(request)

    def params_for(self, request_id: str) -> KVTransferParams | None:
        """The `kv_transfer_params` answering a `do_remote_decode` request (None: none held)."""
        held = self.holds.get(request_id) if self.holds is not None else None
        if held is None or self._channel is None:
            return None
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=held.block_ids,
            remote_host=self.config.kv_transfer_host,
            remote_port=self._channel.port,
            remote_request_id=request_id,
            remote_last_block_hash=held.last_hash.hex() if held.last_hash else None,
        )

    async def pull(self, request: Request, params: KVTransferParams) -> int:
        """Prompt tokens pulled from the producer `params` names (0: none; it computes them)."""
        if self._puller is None or not params.pullable:
            return 0
        return await self._puller.pull(request, params) * self._block_size

    def pull_stats(self) -> PullStats | None:
        return self._puller.stats if self._puller is not None else None

    def stats(self) -> KVTransferStats:
        pulls, holds = self._puller.stats if self._puller else PullStats(), self.holds
        return KVTransferStats(
            num_pulls=pulls.num_pulls,
            num_pulled_blocks=pulls.num_pulled_blocks,
            num_local_blocks=pulls.num_local_blocks,
            num_failed_pulls=pulls.num_failed,
            num_quarantined_blocks=pulls.num_quarantined_blocks,
            pull_seconds=pulls.seconds_total,
            num_held_blocks=holds.num_held_blocks if holds else 0,
            num_released=holds.num_released if holds else 0,
            num_expired=holds.num_expired if holds else 0,
        )

    async def close(self) -> None:
        self._stopping.set()
        if self._progress is not None:
            await asyncio.to_thread(self._progress.join)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.holds is not None:
            self.holds.close()
        if self._puller is not None:
            self._puller.close()
        self._agent.close()
