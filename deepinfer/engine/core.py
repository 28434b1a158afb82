"""`EngineCore`: the synchronous heart (scheduler + cache manager + runner), no asyncio.

`AsyncEngine` drives it from the event loop: each scheduler lane (prefill and decode, or one
colocated lane) has a worker that runs `execute` on its own thread. Tests and offline users may
call `step()` directly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.disk.config import DAY_S, DiskTierConfig
from deepinfer.cache.disk.tier import DiskTier
from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import Config, ConfigError, DiskCacheConfig
from deepinfer.errors import ModelLoadError
from deepinfer.model.kv_layout import allocate_kv_caches, kv_bytes_per_block
from deepinfer.model.loader import LoadedModel, load_model, model_fingerprint
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import Request
from deepinfer.runner.cuda_graphs import capture_decode_graphs
from deepinfer.runner.device import resolve_device, resolve_dtype, resolve_kv_dtype
from deepinfer.runner.host_kv import open_host_tier
from deepinfer.runner.kv_transfer import read_blocks, write_blocks
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.scheduler.cost_model import CostCoefficients, CostModelConfig, StepCostModel
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.lanes import StepLane
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.scheduler.prefill_types import PlannerStats, PrefillPlannerConfig
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.text.recipe import ChatRecipe
from deepinfer.text.tokenizer import Tokenizer

log = logging.getLogger("deepinfer.engine")


@dataclass(frozen=True)
class RuntimeInfo:
    """What start-up discovered (never written back into Config)."""

    model_name: str
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    fingerprint: str
    attention_backend: str
    quantized_bytes: int = 0
    """Bytes of matrices served in GGUF blocks by the native CPU kernel (0: none)."""
    int8_activations: bool = False
    """That kernel quantizes activations to int8 blocks (integer dot products)."""
    decode_graph_sizes: tuple[int, ...] = ()
    """Batch sizes whose decode steps replay from CUDA graphs (empty: eager)."""


def _build_tokenizer(loaded: LoadedModel, path: Path) -> Tokenizer:
    if loaded.gguf_reader is not None:
        return Tokenizer.from_gguf(loaded.gguf_reader)
    return Tokenizer.from_dir(path)


def open_disk_tier(config: DiskCacheConfig, fingerprint: str) -> DiskTier | None:
    """The disk tier for this model fingerprint, or None when disabled. Never raises for I/O:
    an unusable directory leaves the tier degraded (misses, dropped writes, a warning)."""
    if not config.enabled:
        return None
    tier = DiskTier(
        fingerprint,
        DiskTierConfig(
            cache_dir=config.cache_dir,
            max_bytes=config.max_bytes,
            retention_s=(("agent", config.agent_days * DAY_S), ("chat", config.chat_days * DAY_S)),
            default_retention=config.default_retention,
        ),
    )
    tier.open()
    return tier


_CPU_COST_PRIOR = CostCoefficients(step_s=0.01, token_s=6e-3, attention_s=5e-8)
"""A prefill step on one CPU core, roughly (SmolLM2-135M): the model refines it within steps."""


def _planner_config(config: Config, device: torch.device) -> PrefillPlannerConfig:
    w = config.workers
    step_ms = w.prefill_step_ms or (50.0 if device.type == "cuda" else 1000.0)
    num_buckets = len(w.prefill_buckets) + 1
    return PrefillPlannerConfig(
        step_budget_ms=step_ms,
        boundaries=w.prefill_buckets,
        bucket_weights=tuple(float(2 ** max(0, 2 - i)) for i in range(num_buckets)),
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=w.prefill_max_batched_tokens,
        chunk_align_tokens=config.cache.block_size,
    )


def _build_scheduler(
    config: Config, kv: KVCacheManager, max_len: int, device: torch.device
) -> Scheduler | DisaggScheduler:
    if config.workers.colocated:
        return Scheduler(config.scheduler, kv, max_len)
    prior = _CPU_COST_PRIOR if device.type == "cpu" else CostModelConfig().prior
    return DisaggScheduler(
        config.scheduler,
        _planner_config(config, device),
        kv,
        max_len,
        StepCostModel(CostModelConfig(prior=prior)),
    )


CPU_KV_MEMORY_CAP = 4 << 30
"""Default KV pool on CPU: a quarter of physical memory, at most this."""


def _kv_memory_bytes(config: Config, device: torch.device) -> int:
    if config.cache.kv_memory_bytes is not None:
        return config.cache.kv_memory_bytes
    if device.type != "cpu":
        return 1 << 30
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not every platform reports it
        return 1 << 30
    return max(1 << 30, min(CPU_KV_MEMORY_CAP, physical // 4))


def _kv_dtype(
    config: Config, dtype: torch.dtype, backend: str, device: torch.device
) -> torch.dtype:
    """The KV cache dtype; a narrower one than the serving dtype needs a CPU backend (the Triton
    kernels read caches of the queries' dtype). `auto` narrows on CPU only."""
    narrow_ok = device.type == "cpu" and backend != "triton"
    kv_dtype = resolve_kv_dtype(config.cache.kv_dtype, dtype, narrow_ok)
    if kv_dtype != dtype and backend == "triton":
        raise ConfigError(
            f"--kv-dtype {config.cache.kv_dtype} under {dtype} serving needs the cpu or torch "
            "attention backend, not triton"
        )
    return kv_dtype


def _num_blocks(config: Config, bytes_per_block: int, device: torch.device) -> int:
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    return max(2, _kv_memory_bytes(config, device) // bytes_per_block)


class EngineCore:
    def __init__(self, config: Config) -> None:
        self.config = config
        path = config.model.resolved_path()
        device = resolve_device(config.runtime.device)
        dtype = resolve_dtype(config.model.dtype, device)
        if config.runtime.num_threads and device.type == "cpu":
            torch.set_num_threads(config.runtime.num_threads)
        loaded = load_model(
            path,
            dtype,
            device,
            config.runtime.attention_backend,
            config.model.quantized_matmul,
            config.model.matmul_activations,
        )
        self.tokenizer = _build_tokenizer(loaded, path)
        self.recipe = ChatRecipe.for_tokenizer(self.tokenizer)
        block_size = config.cache.block_size
        model = loaded.model
        kv_dtype = _kv_dtype(config, dtype, model.attention_backend.name, device)
        block_bytes = kv_bytes_per_block(loaded.arch, block_size, kv_dtype)
        num_blocks = _num_blocks(config, block_bytes, device)
        self.kv_caches = allocate_kv_caches(loaded.arch, num_blocks, block_size, kv_dtype, device)
        model.bind_kv_caches(self.kv_caches)
        fingerprint = model_fingerprint(loaded, dtype, block_size, kv_dtype)
        max_len = min(loaded.arch.max_position_embeddings, (num_blocks - 1) * block_size)
        if config.model.max_model_len is not None:
            max_len = min(max_len, config.model.max_model_len)
        if max_len < 16:
            raise ModelLoadError(f"the KV pool of {num_blocks} blocks is too small to serve")
        graphs = capture_decode_graphs(
            config.runtime.cuda_graphs,
            model,
            device,
            config.scheduler.max_num_seqs,
            -(-max_len // block_size),
        )
        self.info = RuntimeInfo(
            model_name=config.server.served_model_name or path.stem,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_len,
            fingerprint=fingerprint,
            attention_backend=model.attention_backend.name,
            quantized_bytes=loaded.quantized_bytes,
            int8_activations=loaded.int8_activations,
            decode_graph_sizes=graphs.sizes if graphs is not None else (),
        )
        self.kv = KVCacheManager(
            num_blocks, block_size, fingerprint, config.cache.enable_prefix_caching
        )
        self.disk = open_disk_tier(config.disk_cache, fingerprint)
        self.host = (
            open_host_tier(config.host_cache, device, self.kv_caches)
            if config.cache.enable_prefix_caching
            else None
        )
        self.kv.track_new_blocks = self.disk is not None or self.host is not None
        self.scheduler = _build_scheduler(config, self.kv, max_len, device)
        self.lanes: tuple[StepLane, ...] = self.scheduler.lanes()
        """One lane (colocated) or two (prefill, decode); each is run by one worker."""
        self.runner = ModelRunner(model, block_size, device, config.runtime.seed, graphs)
        log.info("engine ready: %s", self.info)

    # -- a step of each lane: schedule and update on the caller's thread, execute anywhere --
    def execute(self, so: ScheduleOutput) -> RunnerOutput:
        return self.runner.execute(so)

    def update(self, lane: StepLane, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        deltas = lane.update(so, out)
        self.runner.release([c.request_id for c in so.chunks if c.request.is_finished])
        return deltas

    def step(self) -> list[TokenDelta]:
        """One step of each lane in turn (offline use and tests; the async engine overlaps
        the lanes' steps instead)."""
        deltas: list[TokenDelta] = []
        for lane in self.lanes:
            if lane.has_work:
                so = lane.schedule()
                deltas += self.update(lane, so, self.execute(so))
        return deltas

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        aborted = self.scheduler.abort(request_id)
        self.runner.release([request_id])
        return aborted

    # -- lower tiers: KV tensor copies, run off the loop (on blocks no step writes) --
    def snapshot_blocks(self, block_ids: list[int]) -> list[bytes]:
        return read_blocks(self.kv_caches, block_ids)

    def fill_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        write_blocks(self.kv_caches, block_ids, payloads)

    def offer_to_disk(
        self, blocks: list[tuple[BlockHash, str | None]], payloads: list[bytes]
    ) -> None:
        if self.disk is not None:
            for (block_hash, retention), payload in zip(blocks, payloads, strict=True):
                self.disk.offer(block_hash, payload, self.info.block_size, retention)

    def close(self) -> None:
        """Write what the disk tier has queued and stop its writer (blocking)."""
        if self.disk is not None:
            self.disk.close()

    def prefill_stats(self) -> PlannerStats | None:
        """The prefill planner's queues and cost model (disaggregated mode only)."""
        if isinstance(self.scheduler, DisaggScheduler):
            return self.scheduler.planner_stats()
        return None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
