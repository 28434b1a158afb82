"""Building tensor parallelism (`--tensor-parallel N`): this machine's ranks other than 0 (each
loads its shard, sizes its KV pool as rank 0 says, and follows rank 0's forwards), and rank 0's
side of the group (`runner/tensor_ranks.py`)."""

from __future__ import annotations

import logging
from os import cpu_count as _cpu_count
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer.config import Config
from deepinfer.engine.build_replicas import load
from deepinfer.engine.kv_sizing import kv_cache_dtype
from deepinfer.errors import ConfigError
from deepinfer.model.arch import ModelArch
from deepinfer.model.kv_layout import allocate_kv_caches
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.loading.loader import read_arch
from deepinfer.model.loading.sharding import shard_plan
from deepinfer.model.null_model import is_null_model
from deepinfer.runner.device import resolve_device, resolve_dtype
from deepinfer.runner.rank_processes import spawn_ranks
from deepinfer.runner.tensor_ranks import (
    CHAINED_SUMS,
    TPLeader,
    TPRanks,
    follow_steps,
    init_rank,
    local_ranks,
    ready,
    shard_layers,
    share_num_blocks,
)

log = logging.getLogger(__name__)


def tp_threads(config: Config) -> int:
    """A CPU rank's torch threads: `--threads`, else the machine's cores over its ranks."""
    per_node = config.tensor_parallel.tensor_parallel // config.experts.nnodes
    return config.runtime.num_threads or max(1, (_cpu_count() or 1) // per_node)


def check_tensor_parallel(config: Config) -> None:
    tp, e = config.tensor_parallel, config.experts
    if tp.tensor_parallel_backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--tensor-parallel-backend nccl needs CUDA devices")
    if e.node_rank >= e.nnodes or tp.tensor_parallel % e.nnodes:
        raise ConfigError(
            f"--tensor-parallel {tp.tensor_parallel} must divide over --nnodes {e.nnodes}, "
            f"--node-rank {e.node_rank} be below it"
        )
    if config.runtime.cuda_graphs == "on":
        raise ConfigError("--tensor-parallel: steps run eagerly (--cuda-graphs auto or off)")
    if config.speculative.speculative == "mtp":  # (DeepSeek-V3's: latent attention, not split)
        raise ConfigError("--tensor-parallel: an MTP layer is not split yet")
    if config.model.batch_invariant and (
        config.model.matmul_activations == "float32" or tp.tensor_parallel_backend == "nccl"
    ):
        raise ConfigError(CHAINED_SUMS)
    w = config.workers
    if w.prefill_devices != w.decode_devices:
        raise ConfigError("--tensor-parallel: one device group (the ranks are the split)")


def check_split(config: Config, arch: ModelArch) -> None:
    world = config.tensor_parallel.tensor_parallel
    shard_plan(arch, world, 0)
    if arch.moe is not None and config.experts.expert_parallel != world:
        raise ConfigError(
            f"--tensor-parallel {world}: a Mixture-of-Experts model's experts go over the same "
            f"ranks (add --expert-parallel {world})"
        )


def start_ranks(config: Config, path: Path) -> TPRanks:
    """Start this machine's ranks other than 0; on node 0 join them as rank 0 (blocking until
    every rank of every node has joined)."""
    check_tensor_parallel(config)
    if not is_null_model(path):  # before any rank starts: a model the ranks cannot split
        check_split(config, read_arch(path))
    processes = spawn_ranks(rank_main, config, path, local_ranks(config), "deepinfer-tp-rank")
    leader = None
    if config.experts.node_rank == 0:
        init_rank(config, 0)
        leader = TPLeader()
    return TPRanks(processes, leader)


def lead(config: Config, ranks: TPRanks, model: LlamaForCausalLM, num_blocks: int) -> None:
    """Rank 0, its replica built: the ranks size their pools, and each forward is sent them."""
    assert ranks.leader is not None
    shard_layers(model, config.model.batch_invariant)
    share_num_blocks(num_blocks)
    ready()
    model.step_leader = ranks.leader


def run_node(config: Config) -> None:
    """`deepinfer serve --node-rank K` (K > 0): this machine's ranks, until rank 0 stops them."""
    ranks = start_ranks(config, config.model.resolved_path())
    log.info("tensor-parallel ranks %s of node %d running", local_ranks(config),
             config.experts.node_rank)  # fmt: skip
    ranks.close(timeout_s=None)


def rank_main(config: Config, path: str, rank: int, local_rank: int) -> None:
    """A rank's process: join the group, load its shard, follow rank 0 until it stops."""
    init_rank(config, rank)
    try:
        device = resolve_device(config.runtime.device)
        if config.tensor_parallel.tensor_parallel_backend == "nccl":
            device = torch.device("cuda", local_rank)
        dtype = resolve_dtype(config.model.dtype, device)
        world = config.tensor_parallel.tensor_parallel
        if device.type == "cpu":  # the machine's cores shared among its ranks
            torch.set_num_threads(tp_threads(config))
        loaded = load(config, Path(path), dtype, device, tensor_parallel=(rank, world))
        model = loaded.model
        assert isinstance(model, LlamaForCausalLM)
        shard_layers(model, config.model.batch_invariant)
        kv_dtype = kv_cache_dtype(config.cache, dtype, model.attention_backend.name, device)
        num_blocks = share_num_blocks(None)
        model.bind_kv_caches(
            allocate_kv_caches(model.arch, num_blocks, config.cache.block_size, kv_dtype, device)
        )
        ready()
        follow_steps(model)
    finally:
        dist.destroy_process_group()
