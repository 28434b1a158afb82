"""Expert-parallel groups in other processes: torch.distributed ranks that run expert layers only.

Rank 0 is the serving process (API, scheduler, caches, every layer but the other groups'
experts); rank g > 0 holds group g's experts. `RankGroup` is rank 0's view of a rank: each
layer's exchange is a header, the slices' experts and row counts, the rows, then the outputs
back, under a lock (the prefill and decode workers may call it at once; one exchange at a time
keeps the messages of a pair in order). `serve_experts` is the other ranks' loop. A placement
is a message too, so a rank sees it between two exchanges.

Launch: `deepinfer serve --expert-parallel N --expert-parallel-backend gloo|nccl` on node 0
starts its share of the N ranks (N / `--nnodes` processes, itself rank 0) and serves; on
another machine the same command with `--node-rank K --master-addr HOST` starts ranks
K * N / nnodes onwards and waits for them, as torchrun users expect. Every rank loads the model
file itself (same path on every machine) and computes the experts its placement gives it (its
weights are read in place: a placement moves no bytes between processes).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from deepinfer.config import Config
from deepinfer.model.experts.parallel import LocalGroup
from deepinfer.model.experts.placement import ExpertSlice
from deepinfer.runner.rank_processes import join_ranks

log = logging.getLogger(__name__)

RUN, PLACE, STOP = 0, 1, 2
"""Message kinds: compute these rows; hold these experts; leave the loop."""
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


class RankGroup:
    """Rank 0's handle on group `rank`, a process of its own. Should the rank fail (its process
    gone: the exchange raises), its runs go to `fallback` from then on, a group of this process
    that reads every expert in place (rank 0 loads the whole model): the same arithmetic, so
    the same outputs, and no request fails past the step that found the rank gone."""

    def __init__(
        self,
        rank: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        fallback: LocalGroup,
    ) -> None:
        self.rank = rank
        self._hidden = hidden_size
        self._dtype = dtype
        self._device = device
        """Where messages live: the CPU for gloo, this rank's GPU for NCCL."""
        self._fallback = fallback
        self._lock = threading.Lock()
        self.failed: str | None = None
        """Why the rank is out of service (None: serving)."""

    def _header(self, kind: int, layer: int, n: int, rows: int) -> None:
        header = torch.tensor([kind, layer, n, rows], dtype=torch.int64, device=self._device)
        dist.send(header, self.rank)

    def run(self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]) -> torch.Tensor:
        if self.failed is None:
            try:
                return self._exchange(layer, rows, slices)
            except RuntimeError as exc:  # gloo and NCCL errors, a peer's closed socket among them
                self._fail(exc)
        return self._fallback.run_any(layer, rows, slices)

    def _exchange(
        self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]
    ) -> torch.Tensor:
        spec = [v for s in slices for v in (s.expert, s.count)]
        x = torch.cat([rows[s.start : s.start + s.count] for s in slices]).to(self._device)
        y = torch.empty_like(x)
        with self._lock:
            self._header(RUN, layer, len(slices), x.shape[0])
            dist.send(torch.tensor(spec, dtype=torch.int64, device=self._device), self.rank)
            dist.send(x.contiguous(), self.rank)
            dist.recv(y, self.rank)
        return y.to(rows.device)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = f"{type(exc).__name__}: {exc}"
                log.error(
                    "expert rank %d failed (%s); its experts run in this process from now on",
                    self.rank, self.failed,
                )  # fmt: skip

    def place(self, layer: int, experts: tuple[int, ...]) -> None:
        if self.failed is not None:
            return
        try:
            with self._lock:
                self._header(PLACE, layer, len(experts), 0)
                dist.send(torch.tensor(experts, dtype=torch.int64, device=self._device), self.rank)
        except RuntimeError as exc:
            self._fail(exc)

    def close(self) -> None:
        if self.failed is not None:
            return
        try:
            with self._lock:
                self._header(STOP, 0, 0, 0)
        except RuntimeError as exc:
            self._fail(exc)


def serve_experts(group: LocalGroup, hidden_size: int, dtype: torch.dtype) -> None:
    """A rank's loop: runs rank 0's exchanges on `group` until told to stop."""
    device = group.device if dist.get_backend() == "nccl" else torch.device("cpu")
    header = torch.empty(4, dtype=torch.int64, device=device)
    while True:
        dist.recv(header, 0)
        kind, layer, n, num_rows = header.tolist()
        if kind == STOP:
            return
        spec = torch.empty(n * (2 if kind == RUN else 1), dtype=torch.int64, device=device)
        dist.recv(spec, 0)
        if kind == PLACE:
            group.place(layer, tuple(spec.tolist()))
            continue
        x = torch.empty(num_rows, hidden_size, dtype=dtype, device=device)
        dist.recv(x, 0)
        slices, start = [], 0
        for expert, count in zip(spec[0::2].tolist(), spec[1::2].tolist(), strict=True):
            slices.append(ExpertSlice(expert, start, count))
            start += count
        with torch.inference_mode():
            y = group.run(layer, x, slices)
        dist.send(y.to(device).contiguous(), 0)


@dataclass
class ExpertRanks:
    """This machine's expert-parallel processes (rank 0's machine: all but rank 0)."""

    processes: list[BaseProcess]
    serving: bool
    """This process is rank 0 and joined the process group."""

    def close(self, timeout_s: float | None = 30.0) -> None:
        join_ranks(self.processes, timeout_s)
        if self.serving and dist.is_initialized():
            dist.destroy_process_group()


def init_rank(config: Config, rank: int) -> None:
    e = config.experts
    dist.init_process_group(
        e.expert_parallel_backend,
        init_method=f"tcp://{e.master_addr}:{e.master_port}",
        rank=rank,
        world_size=e.expert_parallel,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def local_ranks(config: Config) -> range:
    """The ranks this machine runs."""
    e = config.experts
    per_node = e.expert_parallel // e.nnodes
    return range(e.node_rank * per_node, (e.node_rank + 1) * per_node)
