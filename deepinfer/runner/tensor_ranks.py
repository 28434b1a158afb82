"""Tensor-parallel ranks over torch.distributed (`--tensor-parallel N`): rank 0 serves (API,
scheduler, caches, sampling) and runs its shard of every forward; ranks 1..N-1 run theirs, in
lockstep. Before each forward rank 0 broadcasts the batch (`TPLeader.step`, one forward at a
time: the prefill and decode workers take turns); every rank then runs the same layers on its
heads and FFN features, the row-cut projections' partial outputs summed rank to rank over gloo
(`chained_sum`: the int8 kernel's give one rank's bits whatever the rank count) or by NCCL's
all-reduce.

A rank that fails (its process gone) fails the collective it was in: rank 0 turns that into a
`FatalEngineError`, so the engine stops serving with the reason (the server answers 503 and
`/health` says why) rather than answer from part of a model; a restart starts the ranks again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from deepinfer.config import Config
from deepinfer.errors import ConfigError, FatalEngineError
from deepinfer.kernels.linear.int8_matmul import Int8PackedWeight
from deepinfer.model.experts.moe import MoEBlock
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.llama_layers import LlamaDecoderLayer
from deepinfer.model.loading.sharding import cut
from deepinfer.model.tensor_parallel import ShardProduct
from deepinfer.runner.rank_processes import join_ranks

log = logging.getLogger(__name__)

STEP, STOP = 0, 1
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
CHAINED_SUMS = (
    "--batch-invariant with --tensor-parallel: the ranks' sums go on one from another in the "
    "int8 CPU kernel alone (a GGUF file on CPU, gloo, --matmul-activations auto or int8)"
)


def all_reduce(product: ShardProduct, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The sum over the ranks of a row-cut projection's partial outputs (NCCL's all-reduce)."""
    out = product(None).contiguous()
    dist.all_reduce(out)
    return out


def chained_sum(product: ShardProduct, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The sum over gloo ranks: rank r goes on from rank r-1's sums (its slice of the input
    features follows theirs), and the last rank's output is broadcast to all. The int8 kernel
    adds the blocks of K one after another, so where it serves the projection the result has
    the bits of one rank's whole product, whatever the rank count. It is also the faster sum
    over gloo here: a step's [8, 576] partials summed in 0.28 ms over 2 ranks and 0.83 ms
    over 4, against 1.64 and 5.74 ms by gloo's all-reduce (bench/RESULTS.md)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    before = None
    if rank > 0:
        before = torch.empty(shape, dtype=dtype)
        dist.recv(before, rank - 1)
    out = product(before).contiguous()
    if rank < world - 1:
        dist.send(out, rank + 1)
    dist.broadcast(out, world - 1)
    return out


def shard_layers(model: LlamaForCausalLM, batch_invariant: bool) -> None:
    """Sum each layer's o_proj and down_proj outputs over the ranks (gloo: chained, NCCL:
    all-reduce), layer by layer (the native stack sums within one process); with
    `batch_invariant`, every row-cut projection must be the int8 kernel's (one rank's bits)."""
    model.native_layers = False
    reduce = chained_sum if dist.get_backend() == "gloo" else all_reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer), "Llama-family layers only"
        row_cut = [layer.self_attn.o_proj]
        if not isinstance(layer.mlp, MoEBlock):
            row_cut.append(layer.mlp.down_proj)
        else:  # its experts spread over the ranks, its output summed whole
            if batch_invariant:
                raise ConfigError(
                    "--batch-invariant with --tensor-parallel: dense models only (the experts' "
                    "outputs are added, not continued, over the ranks)"
                )
            layer.mlp.experts_here = cut(layer.mlp.moe.num_experts, world, rank)
            layer.mlp.reduce = reduce
        for linear in row_cut:
            if (
                batch_invariant
                and linear.in_features
                and not isinstance(linear.quantized, Int8PackedWeight)
            ):
                raise ConfigError(CHAINED_SUMS)
            linear.reduce = reduce


class TPLeader:
    """Rank 0's side (`model.step_leader`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failed: str | None = None

    @contextlib.contextmanager
    def step(self, batch: ForwardBatch, num_layers: int | None) -> Iterator[None]:
        with self._lock:
            if self.failed is not None:
                raise FatalEngineError(f"a tensor-parallel rank is gone: {self.failed}")
            try:
                dist.broadcast_object_list([(STEP, batch, num_layers)], src=0)
                yield
            except (RuntimeError, dist.DistBackendError) as exc:  # gloo/NCCL: a peer gone
                self.failed = f"{type(exc).__name__}: {exc}"
                log.error("tensor-parallel step failed: %s", self.failed)
                raise FatalEngineError(f"a tensor-parallel rank is gone: {self.failed}") from exc

    def stop(self) -> None:
        """Tell the other ranks to leave their loops."""
        with self._lock:
            if self.failed is None:
                try:
                    dist.broadcast_object_list([(STOP, None, None)], src=0)
                except (RuntimeError, dist.DistBackendError) as exc:
                    log.warning("stopping the tensor-parallel ranks: %s", exc)


def follow_steps(model: LlamaForCausalLM) -> None:
    """Ranks 1..N-1: run rank 0's forwards on this shard until told to stop."""
    box: list[object] = [None]
    while True:
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        assert isinstance(message, tuple)
        kind, batch, num_layers = message
        if kind == STOP:
            return
        assert isinstance(batch, ForwardBatch)
        with torch.inference_mode():
            model.forward_hidden(batch, num_layers)


def share_num_blocks(num_blocks: int | None) -> int:
    """Rank 0 gives its KV pool's size (the block ids are its); the others receive it."""
    box = torch.tensor([num_blocks or 0], dtype=torch.int64)
    dist.broadcast(box, src=0)
    return int(box.item())


def ready() -> None:
    """Every rank has its shard and its pool: a rank whose load failed (its process gone) fails
    rank 0's start-up here, not its first request."""
    dist.barrier()


def init_rank(config: Config, rank: int) -> None:
    e, tp = config.experts, config.tensor_parallel
    dist.init_process_group(
        tp.tensor_parallel_backend,
        init_method=f"tcp://{e.master_addr}:{e.master_port}",
        rank=rank,
        world_size=tp.tensor_parallel,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def local_ranks(config: Config) -> range:
    """The ranks this machine runs."""
    e = config.experts
    per_node = config.tensor_parallel.tensor_parallel // e.nnodes
    return range(e.node_rank * per_node, (e.node_rank + 1) * per_node)


@dataclass
class TPRanks:
    """This machine's tensor-parallel processes (on rank 0's machine: all but rank 0)."""

    processes: list[BaseProcess]
    leader: TPLeader | None
    """Rank 0's side, on its machine."""

    def abort(self) -> None:
        """Start-up failed: end the ranks where they wait, and leave the group."""
        for process in self.processes:
            process.terminate()
            process.join(10)
        if self.leader is not None and dist.is_initialized():
            dist.destroy_process_group()

    def close(self, timeout_s: float | None = 30.0) -> None:
        if self.leader is not None:
            self.leader.stop()
        join_ranks(self.processes, timeout_s)
        if self.leader is not None and dist.is_initialized():
            dist.destroy_process_group()
