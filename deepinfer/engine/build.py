"""Building what `EngineCore` runs on, one small function per part: device groups, each group's
model replica and KV pool (`build_replicas.py`), the host and disk tiers, the block managers, the
scheduler (`build_scheduler.py`: colocated or disaggregated), the structured-output compiler, the
runners and the KV copier between pools.

`build_engine(config)` composes them into `EngineParts`, a frozen record the core is constructed
from. A new part is a new function here and a new field there, and it is handed what it needs
when it is made. One fact is still attached right after construction, before anything else sees
the part: a model's KV caches (`bind_kv_caches`, the pool is sized from the loaded model).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import Config, DiskCacheConfig, GrammarConfig, KVEventsConfig, Retention
from deepinfer.engine.build_experts import build_expert_parallel
from deepinfer.engine.build_replicas import (
    Replica,
    Replicas,
    build_replicas,
    capture_graphs,
    capture_prefill,
)
from deepinfer.engine.build_scheduler import build_scheduler
from deepinfer.engine.build_tensor_parallel import lead as lead_tp_ranks
from deepinfer.engine.build_tensor_parallel import start_ranks as start_tp_ranks
from deepinfer.engine.build_tensor_parallel import tp_threads
from deepinfer.engine.kv_sizing import serving_max_len
from deepinfer.errors import ConfigError
from deepinfer.kv_events.publisher import KVEventPublisher
from deepinfer.kv_events.recorder import KVEventRecorder
from deepinfer.kv_events.wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from deepinfer.kv_transfer.connector import KVTransfer
from deepinfer.model.experts.parallel import ExpertParallel
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.loading.loader import LoadedModel, model_fingerprint
from deepinfer.runner.device import resolve_device
from deepinfer.runner.device_groups import DeviceGroups, resolve_device_groups
from deepinfer.runner.kv_handoff import KVCopier
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.runner.step_graphs import StepGraphs
from deepinfer.runner.tensor_ranks import TPRanks
from deepinfer.runner.worker_draft import DRAFT_CONFIDENCE_MIN, Drafter, WorkerDrafter
from deepinfer.runner.worker_mtp import MTPDrafter
from deepinfer.sampling.constraints import CompilerLimits, ConstraintCompiler
from deepinfer.sampling.vocabulary import GrammarVocabulary, vocabulary_from
from deepinfer.scheduler.protocol import EngineScheduler
from deepinfer.text.recipe import ChatRecipe
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.tiers.copies import TierCopies
from deepinfer.tiers.disk.config import DAY_S, DiskTierConfig
from deepinfer.tiers.disk.tier import DiskTier
from deepinfer.tiers.host.opener import open_host_tier
from deepinfer.tiers.host.tier import HostTier
from deepinfer.tiers.kv_tiers import KVTiers

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
    bf16_prefill: bool = False
    """That kernel quantizes activations to int8 blocks (integer dot products)."""
    decode_graph_sizes: tuple[int, ...] = ()
    """Batch sizes whose decode steps replay from CUDA graphs (empty: eager)."""
    prefill_graph_buckets: tuple[int, ...] = ()
    """Token counts whose prefill steps replay from piecewise CUDA graphs (empty: eager)."""
    decode_device: torch.device | None = None
    """The decode worker's own device group, with its own model and KV pool (None: shared)."""
    decode_num_blocks: int = 0
    """Blocks of the decode pool, when it is separate."""
    batch_invariant: bool = False
    """Every request's bits independent of the batch, the chunking and the cache tier."""

    @property
    def system_fingerprint(self) -> str:
        """What responses report as `system_fingerprint`: the model fingerprint's head (weights,
        numerics, KV layout: the keys of the prefix cache) and the arithmetic mode."""
        mode = "batch-invariant" if self.batch_invariant else "default"
        return f"fp_{self.fingerprint[:12]}-{mode}"


@dataclass(frozen=True)
class EngineParts:
    """Everything `EngineCore` runs on, built and wired by `build_engine`."""

    info: RuntimeInfo
    groups: DeviceGroups
    tokenizer: Tokenizer
    recipe: ChatRecipe
    kv: KVCacheManager
    decode_kv: KVCacheManager | None
    """The decode pool's blocks (separate device groups only; no prefix cache there)."""
    tiers: KVTiers
    """The host and disk tiers under the prefill pool (either may be off)."""
    scheduler: EngineScheduler
    constraints: ConstraintCompiler
    """Structured-output grammars: compiled at submit, shared by both runners."""
    runner: ModelRunner
    decode_runner: ModelRunner
    """The decode group's runner (`runner` itself unless split)."""
    copier: KVCopier | None
    """Copies KV from the prefill pool to the decode pool (separate device groups only)."""
    experts: ExpertParallel | None = None
    """A Mixture of Experts' expert-parallel groups and balancer (None: experts all here)."""
    kv_transfer: KVTransfer | None = None
    """KV transfers with other replicas over NIXL (`--kv-transfer nixl`; None: off)."""
    tensor_parallel: TPRanks | None = None
    """The other tensor-parallel ranks' processes and rank 0's side (None: one rank)."""


def build_engine(config: Config) -> EngineParts:
    """Load the model, size and allocate the pools, open the tiers and wire the scheduler and
    runners (blocking: seconds to minutes; call off the event loop)."""
    path = config.model.resolved_path()
    groups = resolve_device_groups(config.workers, resolve_device(config.runtime.device))
    if config.runtime.num_threads and groups.prefill.type == "cpu":
        torch.set_num_threads(config.runtime.num_threads)
    elif config.tensor_parallel.tensor_parallel > 1 and groups.prefill.type == "cpu":
        torch.set_num_threads(tp_threads(config))  # the cores shared among this node's ranks
    world = config.tensor_parallel.tensor_parallel
    tp_ranks = start_tp_ranks(config, path) if world > 1 else None
    try:
        replicas = build_replicas(config, path, groups, (0, world) if tp_ranks else None)
        if tp_ranks is not None:
            assert isinstance(replicas.prefill.model, LlamaForCausalLM)
            lead_tp_ranks(config, tp_ranks, replicas.prefill.model, replicas.prefill.num_blocks)
    except BaseException:
        if tp_ranks is not None:
            tp_ranks.abort()
        raise
    models = [replicas.prefill.model] + ([replicas.decode.model] if replicas.split else [])
    # under tensor parallel the experts are the ranks' (`model/loading/sharding.py`)
    experts = build_expert_parallel(config, path, models) if tp_ranks is None else None
    tokenizer = build_tokenizer(replicas.loaded, path)
    recipe = recipe_for(tokenizer)
    max_len = serving_max_len(
        config.cache.block_size,
        replicas.loaded.arch.max_position_embeddings,
        min(replicas.prefill.num_blocks, replicas.decode.num_blocks),
        config.model.max_model_len,
    )
    graphs = (
        StepGraphs()  # a captured step would replay without its broadcast to the other ranks
        if tp_ranks is not None
        else StepGraphs(
            capture_graphs(config, replicas.decode, max_len),
            capture_prefill(config, replicas.prefill),
        )
    )
    info = runtime_info(config, path, replicas, max_len, graphs)
    events = build_kv_events(config.kv_events, config.cache.block_size)
    host, disk = open_tiers(config, replicas.prefill, info.fingerprint, events)
    kv, decode_kv = build_block_managers(config, replicas, info.fingerprint, host, disk)
    if events is not None:
        # `GPU` is vLLM's name for the engine's own pool whatever the device (its CPU backend
        # says so too); routers read `CPU` as an offload tier and discount its hits.
        kv.events = kv.pool.events = events.recorder.medium(MEDIUM_GPU)
    constraints = ConstraintCompiler(
        lambda: grammar_vocabulary(tokenizer, recipe), compiler_limits(config.grammar)
    )
    runner, decode_runner = build_runners(config, replicas, graphs, constraints)
    parts = EngineParts(
        info=info,
        groups=groups,
        tokenizer=tokenizer,
        recipe=recipe,
        kv=kv,
        decode_kv=decode_kv,
        tiers=KVTiers(kv, host, disk, tier_copies(replicas.prefill), events),
        scheduler=build_scheduler(
            config,
            kv,
            max_len,
            groups.prefill,
            decode_kv,
            replicas.loaded.bf16_prefill,
            mtp=replicas.decode.mtp is not None,
        ),
        constraints=constraints,
        runner=runner,
        decode_runner=decode_runner,
        copier=build_copier(replicas),
        experts=experts,
        kv_transfer=build_kv_transfer(config, kv, replicas, info.fingerprint),
        tensor_parallel=tp_ranks,
    )
    log.info("engine ready: %s", info)
    return parts


def runtime_info(
    config: Config, path: Path, replicas: Replicas, max_len: int, graphs: StepGraphs
) -> RuntimeInfo:
    loaded, prefill, decode = replicas.loaded, replicas.prefill, replicas.decode
    block_size = config.cache.block_size
    return RuntimeInfo(
        model_name=config.server.served_model_name or path.stem,
        device=prefill.device,
        dtype=loaded.dtype,
        kv_dtype=replicas.kv_dtype,
        num_blocks=prefill.num_blocks,
        block_size=block_size,
        max_model_len=max_len,
        fingerprint=model_fingerprint(
            loaded, loaded.dtype, block_size, replicas.kv_dtype, prefill.window is not None
        ),
        attention_backend=loaded.model.attention_backend.name,
        quantized_bytes=loaded.quantized_bytes,
        int8_activations=loaded.int8_activations,
        bf16_prefill=loaded.bf16_prefill,
        decode_graph_sizes=graphs.decode.sizes if graphs.decode is not None else (),
        prefill_graph_buckets=graphs.prefill.buckets if graphs.prefill is not None else (),
        decode_device=decode.device if replicas.split else None,
        decode_num_blocks=decode.num_blocks if replicas.split else 0,
        batch_invariant=loaded.batch_invariant,
    )


# -- text: the tokenizer, and the vocabulary grammars see --
def build_tokenizer(loaded: LoadedModel, path: Path) -> Tokenizer:
    if loaded.gguf_reader is not None:
        return _gguf_tokenizer(loaded.gguf_reader)
    return Tokenizer.from_dir(path)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(reader: Any) -> Tokenizer:
    """The tokenizer of an open GGUF file, built once per reader: an engine started again on the
    same file in this process (the loader reuses the file's parsed reader) skips the rebuild
    (Gemma 3's 262k-token vocabulary: about 4 s). Tokenizers are never mutated once built."""
    return Tokenizer.from_gguf(reader)


def compiler_limits(config: GrammarConfig) -> CompilerLimits:
    return CompilerLimits(
        max_cached_bytes=config.grammar_cache_mb << 20,
        compile_timeout_s=config.grammar_compile_timeout_s,
    )


def grammar_vocabulary(tokenizer: Tokenizer, recipe: ChatRecipe) -> GrammarVocabulary:
    """The vocabulary grammars see; their end token is the recipe's end of turn."""
    ends = recipe.end_of_turn_ids
    eos = tokenizer.eos_token_id
    if eos is None or (ends and eos not in ends):
        eos = min(ends) if ends else 0
    return vocabulary_from(tokenizer, eos)


# -- blocks and their lower tiers --
def build_kv_events(config: KVEventsConfig, block_size: int) -> KVEventPublisher | None:
    """The KV events' publisher and its sockets (None: `--kv-events-endpoint` not set)."""
    if config.kv_events_endpoint is None:
        return None
    recorder = KVEventRecorder(
        block_size, config.kv_events_block_hash, config.kv_events_max_queue_size
    )
    publisher = KVEventPublisher(
        recorder,
        config.kv_events_endpoint,
        config.kv_events_replay_endpoint,
        config.kv_events_topic,
        config.kv_events_buffer_steps,
        config.kv_events_hwm,
    )
    log.info("publishing KV events on %s", config.kv_events_endpoint)
    return publisher


def open_tiers(
    config: Config, prefill: Replica, fingerprint: str, events: KVEventPublisher | None = None
) -> tuple[HostTier | None, DiskTier | None]:
    """The host tier (prefix caching only) and the disk tier under the prefill pool, each
    recording its KV events when `events` is given. Neither with tensor parallel: they would
    keep rank 0's shard of each block alone."""
    if config.tensor_parallel.tensor_parallel > 1:
        log.info("host and disk KV tiers off: --tensor-parallel")
        return None, None
    host = None
    if config.cache.enable_prefix_caching:
        host = open_host_tier(config.host_cache, prefill.device, prefill.tier_caches)
    if host is not None and events is not None:
        host.events = events.recorder.medium(MEDIUM_CPU)
    return host, open_disk_tier(config.disk_cache, fingerprint, events)


def build_kv_transfer(
    config: Config, kv: KVCacheManager, replicas: Replicas, fingerprint: str
) -> KVTransfer | None:
    """The NIXL agent over the prefill pool, its holds and puller (`--kv-transfer nixl`). A
    sliding-window model moves its full-attention layers' blocks (the tiers' payload): a pulled
    prefix is a hit like any other, whose windowed layers the consumer rebuilds by replay."""
    if config.kv_transfer.kv_transfer == "off":
        return None
    return KVTransfer(config.kv_transfer, kv, replicas.prefill.tier_caches, fingerprint)


def tier_copies(prefill: Replica) -> TierCopies:
    """The copies between the prefill pool's blocks and the tiers' payloads: all layers, or the
    full layers' (a windowed pool's layers have their own caches)."""
    return TierCopies(prefill.tier_caches, prefill.window_caches)


def open_disk_tier(
    config: DiskCacheConfig, fingerprint: str, events: KVEventPublisher | None = None
) -> DiskTier | None:
    """The disk tier for this model fingerprint, or None when disabled. Never raises for I/O:
    an unusable directory leaves the tier degraded (misses, dropped writes, a warning)."""
    if not config.enabled:
        return None
    tier = DiskTier(
        fingerprint,
        DiskTierConfig(
            cache_dir=config.cache_dir,
            max_bytes=config.max_bytes,
            retention_s=(
                (Retention.AGENT, config.agent_days * DAY_S),
                (Retention.CHAT, config.chat_days * DAY_S),
            ),
            default_retention=config.default_retention,
        ),
    )
    if events is not None:
        tier.events = events.recorder.medium(MEDIUM_STORAGE)
    tier.open()
    return tier


def build_block_managers(
    config: Config,
    replicas: Replicas,
    fingerprint: str,
    host: HostTier | None,
    disk: DiskTier | None,
) -> tuple[KVCacheManager, KVCacheManager | None]:
    """The prefill pool's manager (the prefix cache; it records new blocks for the lower tiers
    when there are any), and the decode pool's when it is separate."""
    block_size = config.cache.block_size
    prefill = replicas.prefill
    kv = KVCacheManager(
        prefill.num_blocks,
        block_size,
        fingerprint,
        config.cache.enable_prefix_caching,
        track_new_blocks=host is not None or disk is not None,
        window=prefill.window,
        num_window_blocks=prefill.num_window_blocks,
    )
    decode_kv = None
    if replicas.split:
        decode_kv = KVCacheManager(replicas.decode.num_blocks, block_size, fingerprint, False)
    return kv, decode_kv


# -- execution --
def build_runners(
    config: Config,
    replicas: Replicas,
    graphs: StepGraphs,
    constraints: ConstraintCompiler,
) -> tuple[ModelRunner, ModelRunner]:
    """(prefill, decode) runners: one runner for both unless split; each replays the graphs
    captured on its group's model (the decode graphs and the prefill pieces)."""
    block_size, seed = config.cache.block_size, config.runtime.seed
    prefill, decode = replicas.prefill, replicas.decode
    drafter = _worker_drafter(config, decode)
    if not replicas.split:
        runner = ModelRunner(
            prefill.model, block_size, prefill.device, seed, graphs, constraints, drafter
        )
        return runner, runner
    prefill_graphs, decode_graphs = StepGraphs(prefill=graphs.prefill), StepGraphs(graphs.decode)
    return (
        ModelRunner(prefill.model, block_size, prefill.device, seed, prefill_graphs, constraints),
        ModelRunner(
            decode.model, block_size, decode.device, seed, decode_graphs, constraints, drafter
        ),
    )


def _worker_drafter(config: Config, decode: Replica) -> Drafter | None:
    """The decode runner's draft maker for `--speculative layers` (the model's first layers),
    `draft-model` (the replica's draft) or `mtp` (the replica's MTP layer); None for other
    methods."""
    spec, block_size = config.speculative, config.cache.block_size
    sure = DRAFT_CONFIDENCE_MIN if spec.speculative_gate == "on" else 0.0
    if decode.draft is not None:
        return WorkerDrafter(decode.draft, block_size, decode.device, None, sure)
    if decode.mtp is not None:
        return MTPDrafter(decode.mtp, block_size, decode.device, sure)
    if spec.speculative != "layers":
        return None
    try:
        return WorkerDrafter(decode.model, block_size, decode.device, spec.draft_layers, sure)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def build_copier(replicas: Replicas) -> KVCopier | None:
    if not replicas.split:
        return None
    return KVCopier(replicas.prefill.kv_caches, replicas.decode.kv_caches)
