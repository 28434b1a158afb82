"""Building expert parallelism for a Mixture-of-Experts model (`--expert-parallel N`,
`--redundant-experts`, `--eplb-interval`): the groups, their first placement, and the ranks of
other processes when the backend is torch.distributed (`runner/expert_ranks.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer.config import Config, check_expert_layout
from deepinfer.engine.build_replicas import load
from deepinfer.errors import ConfigError
from deepinfer.kernels.linear.int8_matmul import FixedOrderWeight, block_linear
from deepinfer.model.experts.moe import MoEForCausalLM
from deepinfer.model.experts.parallel import (
    ExpertGroup,
    ExpertParallel,
    LocalGroup,
    initial_placement,
)
from deepinfer.model.protocol import CausalLM
from deepinfer.runner.device import resolve_device, resolve_dtype
from deepinfer.runner.expert_ranks import (
    ExpertRanks,
    RankGroup,
    init_rank,
    local_ranks,
    serve_experts,
)
from deepinfer.runner.rank_processes import spawn_ranks

log = logging.getLogger(__name__)


def wants_expert_parallel(config: Config) -> bool:
    e = config.experts
    return e.expert_parallel > 1 or e.redundant_experts > 0 or e.eplb_interval > 0


def build_expert_parallel(
    config: Config, path: Path, models: list[CausalLM]
) -> ExpertParallel | None:
    """The groups of `models` (the prefill replica's first; a decode replica shares them), or
    None where the config asks for none or the model has no experts."""
    if not wants_expert_parallel(config):
        return None
    check_expert_layout(config.experts)
    model = models[0]
    if not isinstance(model, MoEForCausalLM) or model.arch.moe is None:
        log.warning("--expert-parallel and EPLB flags ignored: %s has no experts", path.name)
        return None
    e, moe = config.experts, model.arch.moe
    if (moe.num_experts + e.redundant_experts) % e.expert_parallel:
        raise ConfigError(
            f"{moe.num_experts} experts and --redundant-experts {e.redundant_experts} do not "
            f"divide evenly into --expert-parallel {e.expert_parallel} groups"
        )
    ranks: ExpertRanks | None = None
    if e.expert_parallel_backend == "local":
        groups = local_groups(config, model)
    else:
        ranks = start_ranks(config, path)
        device = model.norm.weight.device
        here = _group(model, device)
        comm = device if e.expert_parallel_backend == "nccl" else torch.device("cpu")
        dtype = model.norm.weight.dtype
        groups = [here] + [
            RankGroup(rank, model.arch.hidden_size, dtype, comm, fallback=here)
            for rank in range(1, e.expert_parallel)
        ]
    placements = {
        layer: initial_placement(moe.num_experts, e.expert_parallel, e.redundant_experts)
        for layer in model.blocks()
    }
    parallel = ExpertParallel(
        groups,
        placements,
        eplb_interval=e.eplb_interval,
        redundant=e.redundant_experts,
        nodes=e.nnodes,
        after_close=ranks.close if ranks is not None else None,
    )
    for m in models:
        assert isinstance(m, MoEForCausalLM)
        m.set_expert_parallel(parallel)
    log.info(
        "experts over %d %s groups, %d redundant, EPLB every %s steps",
        e.expert_parallel, e.expert_parallel_backend, e.redundant_experts,
        e.eplb_interval or "no",
    )  # fmt: skip
    return parallel


def _group(model: MoEForCausalLM, device: torch.device, fixed_order: bool = False) -> LocalGroup:
    """A group on `device` reading `model`'s experts (copies of them on another device, through
    the fixed-order matmul in the batch-invariant mode)."""
    here = model.norm.weight.device
    return LocalGroup(
        device,
        model.layer_runners().__getitem__,
        weights=None if device == here else model.expert_weights,
        activation=model.attention_backend.silu_mul,
        linear=_fixed_order_linear if fixed_order else None,
    )


def _fixed_order_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return block_linear(x, FixedOrderWeight(w))


def local_groups(config: Config, model: MoEForCausalLM) -> list[ExpertGroup]:
    """One group per `--expert-devices` entry; by default one GPU each where there are enough,
    else every group on the model's device (CPU thread groups)."""
    e, here = config.experts, model.norm.weight.device
    if e.expert_devices:
        devices = [resolve_device(name) for name in e.expert_devices]
    elif here.type == "cuda" and torch.cuda.device_count() >= e.expert_parallel:
        devices = [torch.device("cuda", g) for g in range(e.expert_parallel)]
    else:
        devices = [here] * e.expert_parallel
    if any(d.type != here.type for d in devices):
        raise ConfigError(f"--expert-devices must be {here.type} devices, like the model's")
    fixed_order = config.model.batch_invariant
    return [_group(model, device, fixed_order) for device in devices]


def start_ranks(config: Config, path: Path) -> ExpertRanks:
    """Start this machine's ranks other than 0 (each loads the model and serves its experts);
    on node 0 join them as rank 0 (blocking until every rank of every node has joined)."""
    if config.experts.expert_parallel_backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--expert-parallel-backend nccl needs CUDA devices")
    processes = spawn_ranks(rank_main, config, path, local_ranks(config), "deepinfer-rank")
    serving = config.experts.node_rank == 0
    if serving:
        init_rank(config, 0)
    return ExpertRanks(processes, serving)


def run_node(config: Config) -> None:
    """`deepinfer serve --node-rank K` (K > 0): this machine's ranks, until rank 0 stops them."""
    check_expert_layout(config.experts)
    ranks = start_ranks(config, config.model.resolved_path())
    log.info("expert ranks %s of node %d running", local_ranks(config), config.experts.node_rank)
    ranks.close(timeout_s=None)


def rank_main(config: Config, path: str, rank: int, local_rank: int) -> None:
    """A rank's process: join the group, load the model, serve its experts until rank 0 stops."""
    init_rank(config, rank)
    try:
        device = resolve_device(config.runtime.device)
        if config.experts.expert_parallel_backend == "nccl":
            device = torch.device("cuda", local_rank)
        dtype = resolve_dtype(config.model.dtype, device)
        model = load(config, Path(path), dtype, device).model
        assert isinstance(model, MoEForCausalLM)
        serve_experts(_group(model, device), model.arch.hidden_size, dtype)
    finally:
        torch.distributed.destroy_process_group()
