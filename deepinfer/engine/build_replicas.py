"""Building each device group's model replica and the KV pool bound to it: the prefill group's,
and the decode group's when the groups are separate devices (else one replica serves both)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.config import Config
from deepinfer.engine.kv_sizing import kv_cache_dtype, num_kv_blocks
from deepinfer.model.kv_layout import KVCaches, allocate_kv_caches, kv_bytes_per_block
from deepinfer.model.loader import LoadedModel, load_model
from deepinfer.model.protocol import CausalLM
from deepinfer.runner.cuda_graphs import DecodeGraphs, capture_decode_graphs
from deepinfer.runner.device import resolve_dtype
from deepinfer.runner.device_groups import DeviceGroups


@dataclass(frozen=True)
class Replica:
    """One device group's model and the KV pool bound to it."""

    model: CausalLM
    kv_caches: KVCaches
    num_blocks: int
    device: torch.device


@dataclass(frozen=True)
class Replicas:
    """The prefill group's replica and the decode group's (the same one unless split)."""

    loaded: LoadedModel
    """The prefill group's load: architecture, tokenizer source, numerics."""
    prefill: Replica
    decode: Replica
    kv_dtype: torch.dtype

    @property
    def split(self) -> bool:
        return self.decode is not self.prefill


def build_replicas(config: Config, path: Path, groups: DeviceGroups) -> Replicas:
    """The prefill group's model and pool, and the decode group's when it is separate."""
    dtype = resolve_dtype(config.model.dtype, groups.prefill)
    loaded = load(config, path, dtype, groups.prefill)
    backend = loaded.model.attention_backend.name
    kv_dtype = kv_cache_dtype(config.cache, dtype, backend, groups.prefill)
    prefill = build_replica(config, loaded, loaded.model, kv_dtype, groups.prefill)
    decode = prefill
    if groups.split:
        decode_model = load(config, path, dtype, groups.decode).model
        decode = build_replica(config, loaded, decode_model, kv_dtype, groups.decode)
    return Replicas(loaded, prefill, decode, kv_dtype)


def load(config: Config, path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    m = config.model
    backend = config.runtime.attention_backend
    return load_model(path, dtype, device, backend, m.quantized_matmul, m.matmul_activations)


def build_replica(
    config: Config,
    loaded: LoadedModel,
    model: CausalLM,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> Replica:
    """A KV pool on `device`, sized by the cache config and bound to `model`."""
    block_size = config.cache.block_size
    block_bytes = kv_bytes_per_block(loaded.arch, block_size, kv_dtype)
    num_blocks = num_kv_blocks(config.cache, block_bytes, device)
    kv_caches = allocate_kv_caches(loaded.arch, num_blocks, block_size, kv_dtype, device)
    model.bind_kv_caches(kv_caches)
    return Replica(model, kv_caches, num_blocks, device)


def capture_graphs(config: Config, decode: Replica, max_len: int) -> DecodeGraphs | None:
    """The decode group's CUDA graphs per `--cuda-graphs` (None: eager decode)."""
    max_blocks = -(-max_len // config.cache.block_size)
    return capture_decode_graphs(
        config.runtime.cuda_graphs,
        decode.model,
        decode.device,
        config.scheduler.max_num_seqs,
        max_blocks,
    )
