"""`EngineCore`: the synchronous heart (scheduler + cache manager + runner), no asyncio.

`AsyncEngine` drives it from the event loop: each scheduler lane (prefill and decode, or one
colocated lane) has a worker that runs `execute` on its own thread. Tests and offline users may
call `step()` directly.

With separate device groups (`runner/device_groups.py`) the core holds two model replicas and two
KV pools: the prefill pool (prefix cache, host and disk tiers) and the decode pool. A prefilled
request's KV is copied from one to the other (`drain_handoffs`, `copy_kv`, `complete_handoff`).
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
from deepinfer.model.kv_layout import KVCaches, allocate_kv_caches, kv_bytes_per_block
from deepinfer.model.loader import LoadedModel, load_model, model_fingerprint
from deepinfer.model.protocol import CausalLM
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import Request
from deepinfer.runner.cuda_graphs import capture_decode_graphs
from deepinfer.runner.device import resolve_device, resolve_dtype, resolve_kv_dtype
from deepinfer.runner.device_groups import DeviceGroups, resolve_device_groups
from deepinfer.runner.host_kv import open_host_tier
from deepinfer.runner.kv_handoff import KVCopier
from deepinfer.runner.kv_transfer import read_blocks, write_blocks
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.sampling.constraints import ConstraintCompiler
from deepinfer.sampling.vocabulary import GrammarVocabulary, vocabulary_from
from deepinfer.scheduler.cost_model import CostCoefficients, CostModelConfig, StepCostModel
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.lanes import StepLane
from deepinfer.scheduler.output import KVHandoff, ScheduleOutput, StepKind
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
    decode_device: torch.device | None = None
    """The decode worker's own device group, with its own model and KV pool (None: shared)."""
    decode_num_blocks: int = 0
    """Blocks of the decode pool, when it is separate."""


def _build_tokenizer(loaded: LoadedModel, path: Path) -> Tokenizer:
    if loaded.gguf_reader is not None:
        return Tokenizer.from_gguf(loaded.gguf_reader)
    return Tokenizer.from_dir(path)


def _grammar_vocabulary(tokenizer: Tokenizer, recipe: ChatRecipe) -> GrammarVocabulary:
    """The vocabulary grammars see; their end token is the recipe's end of turn."""
    ends = recipe.end_of_turn_ids
    eos = tokenizer.eos_token_id
    if eos is None or (ends and eos not in ends):
        eos = min(ends) if ends else 0
    return vocabulary_from(tokenizer, eos)


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
    config: Config,
    kv: KVCacheManager,
    max_len: int,
    device: torch.device,
    decode_kv: KVCacheManager | None,
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
        decode_kv,
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


@dataclass(frozen=True)
class _Replica:
    """One device group's model and KV pool."""

    model: CausalLM
    kv_caches: KVCaches
    num_blocks: int
    device: torch.device


class EngineCore:
    def __init__(self, config: Config) -> None:
        self.config = config
        path = config.model.resolved_path()
        device = resolve_device(config.runtime.device)
        groups = resolve_device_groups(config.workers, device)
        dtype = resolve_dtype(config.model.dtype, device)
        if config.runtime.num_threads and device.type == "cpu":
            torch.set_num_threads(config.runtime.num_threads)
        loaded = self._load(path, dtype, groups.prefill)
        self.tokenizer = _build_tokenizer(loaded, path)
        self.recipe = ChatRecipe.for_tokenizer(self.tokenizer)
        block_size = config.cache.block_size
        kv_dtype = _kv_dtype(config, dtype, loaded.model.attention_backend.name, device)
        prefill = self._replica(loaded, loaded.model, kv_dtype, groups.prefill)
        decode = prefill
        if groups.split:
            decode_model = self._load(path, dtype, groups.decode).model
            decode = self._replica(loaded, decode_model, kv_dtype, groups.decode)
        self.kv_caches = prefill.kv_caches
        """The prefill pool's caches (the prefix cache and its lower tiers)."""
        fingerprint = model_fingerprint(loaded, dtype, block_size, kv_dtype)
        max_len = self._max_len(loaded, min(prefill.num_blocks, decode.num_blocks))
        graphs = capture_decode_graphs(
            config.runtime.cuda_graphs,
            decode.model,
            decode.device,
            config.scheduler.max_num_seqs,
            -(-max_len // block_size),
        )
        self.info = RuntimeInfo(
            model_name=config.server.served_model_name or path.stem,
            device=prefill.device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            num_blocks=prefill.num_blocks,
            block_size=block_size,
            max_model_len=max_len,
            fingerprint=fingerprint,
            attention_backend=loaded.model.attention_backend.name,
            quantized_bytes=loaded.quantized_bytes,
            int8_activations=loaded.int8_activations,
            decode_graph_sizes=graphs.sizes if graphs is not None else (),
            decode_device=groups.decode if groups.split else None,
            decode_num_blocks=decode.num_blocks if groups.split else 0,
        )
        self.groups: DeviceGroups = groups
        self.kv = KVCacheManager(
            prefill.num_blocks, block_size, fingerprint, config.cache.enable_prefix_caching
        )
        self.decode_kv = (
            KVCacheManager(decode.num_blocks, block_size, fingerprint, False)
            if groups.split
            else None
        )
        """The decode pool's blocks (separate device groups only; no prefix cache there)."""
        self.disk = open_disk_tier(config.disk_cache, fingerprint)
        self.host = (
            open_host_tier(config.host_cache, prefill.device, self.kv_caches)
            if config.cache.enable_prefix_caching
            else None
        )
        self.kv.track_new_blocks = self.disk is not None or self.host is not None
        self.scheduler = _build_scheduler(config, self.kv, max_len, device, self.decode_kv)
        self.lanes: tuple[StepLane, ...] = self.scheduler.lanes()
        """One lane (colocated) or two (prefill, decode); each is run by one worker."""
        seed = config.runtime.seed
        self.constraints = ConstraintCompiler(
            lambda: _grammar_vocabulary(self.tokenizer, self.recipe)
        )
        """Structured-output grammars: compiled at submit, shared by both runners."""
        self.runner = ModelRunner(
            prefill.model,
            block_size,
            prefill.device,
            seed,
            None if groups.split else graphs,
            self.constraints,
        )
        self.decode_runner = (
            ModelRunner(decode.model, block_size, decode.device, seed, graphs, self.constraints)
            if groups.split
            else self.runner
        )
        self._copier = KVCopier(prefill.kv_caches, decode.kv_caches) if groups.split else None
        log.info("engine ready: %s", self.info)

    def _load(self, path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        m = self.config.model
        backend = self.config.runtime.attention_backend
        return load_model(path, dtype, device, backend, m.quantized_matmul, m.matmul_activations)

    def _replica(
        self, loaded: LoadedModel, model: CausalLM, kv_dtype: torch.dtype, device: torch.device
    ) -> _Replica:
        """A KV pool on `device`, bound to `model`."""
        block_size = self.config.cache.block_size
        block_bytes = kv_bytes_per_block(loaded.arch, block_size, kv_dtype)
        num_blocks = _num_blocks(self.config, block_bytes, device)
        kv_caches = allocate_kv_caches(loaded.arch, num_blocks, block_size, kv_dtype, device)
        model.bind_kv_caches(kv_caches)
        return _Replica(model, kv_caches, num_blocks, device)

    def _max_len(self, loaded: LoadedModel, num_blocks: int) -> int:
        block_size = self.config.cache.block_size
        max_len = min(loaded.arch.max_position_embeddings, (num_blocks - 1) * block_size)
        if self.config.model.max_model_len is not None:
            max_len = min(max_len, self.config.model.max_model_len)
        if max_len < 16:
            raise ModelLoadError(f"the KV pool of {num_blocks} blocks is too small to serve")
        return max_len

    def lane_device(self, kind: StepKind) -> torch.device:
        """The device a lane's steps run on."""
        return self.groups.decode if kind is StepKind.DECODE else self.groups.prefill

    # -- a step of each lane: schedule and update on the caller's thread, execute anywhere --
    def execute(self, so: ScheduleOutput) -> RunnerOutput:
        runner = self.decode_runner if so.kind is StepKind.DECODE else self.runner
        return runner.execute(so)

    def update(self, lane: StepLane, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        deltas = lane.update(so, out)
        self._release([c.request_id for c in so.chunks if c.request.is_finished])
        return deltas

    def fail(self, lane: StepLane, so: ScheduleOutput) -> list[str]:
        """A step of `lane` failed (execute, or update part way): finish its requests, free
        their blocks and sampling state. Returns the ids whose outputs must end with an error
        (see `StepLane.fail`). Raises if the scheduler is left inconsistent: the engine cannot go on."""
        failed = lane.fail(so)
        self._release([c.request_id for c in so.chunks if c.request.is_finished])
        self.check_integrity()
        return failed

    def _release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)
        if self.decode_runner is not self.runner:
            self.decode_runner.release(request_ids)

    def step(self) -> list[TokenDelta]:
        """One step of each lane in turn, then any KV handoffs (offline use and tests; the
        async engine overlaps the lanes' steps and the copies instead)."""
        deltas: list[TokenDelta] = []
        for lane in self.lanes:
            if lane.has_work:
                so = lane.schedule()
                deltas += self.update(lane, so, self.execute(so))
        for handoff in self.drain_handoffs():
            self.copy_kv(handoff)
            self.complete_handoff(handoff)
        return deltas

    # -- KV handoffs between the pools of separate device groups --
    def drain_handoffs(self) -> list[KVHandoff]:
        """Copies to run now (call on the loop, after any change): see `DisaggScheduler`."""
        if self._copier is None or not isinstance(self.scheduler, DisaggScheduler):
            return []
        return self.scheduler.drain_handoffs()

    def copy_kv(self, handoff: KVHandoff) -> None:
        """Run one handoff's copy to completion (blocking: on the transfer thread)."""
        assert self._copier is not None, "no separate decode pool"
        self._copier.copy(handoff.src_block_ids, handoff.dst_block_ids)

    def complete_handoff(self, handoff: KVHandoff) -> None:
        """After `copy_kv`: the request decodes on the decode device from now on (its random
        stream moves with it), unless it was aborted meanwhile."""
        assert isinstance(self.scheduler, DisaggScheduler)
        rid = handoff.request_id
        self.decode_runner.adopt_generator(rid, self.runner.take_generator(rid))
        self.decode_runner.adopt_matcher(rid, self.runner.take_matcher(rid))
        if not self.scheduler.complete_handoff(rid):
            self._release([rid])

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        aborted = self.scheduler.abort(request_id)
        if self.scheduler.get_request(request_id) is None:  # else deferred to its step or copy
            self._release([request_id])
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
        """Stop the runners' threads, write what the disk tier has queued and stop its writer
        (blocking)."""
        self.runner.close()
        if self.decode_runner is not self.runner:
            self.decode_runner.close()
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
