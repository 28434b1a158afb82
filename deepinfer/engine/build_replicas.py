"""Building each device group's model replica and the KV pool bound to it: the prefill group's,
and the decode group's when the groups are separate devices (else one replica serves both).

With `--speculative draft-model` the decode group's replica carries the draft model too: its KV
lives in caches of its own indexed by the same block ids as the model's, so a block is one unit
of the pool (its bytes are both models' and the pool holds fewer blocks), and the draft needs no
block tables, allocation or accounting of its own. So does `--speculative mtp` with the
checkpoint's multi-token-prediction layer (one layer's KV more a block)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.cache.window_group import WindowSpec
from deepinfer.config import Config
from deepinfer.engine.kv_sizing import kv_cache_dtype, num_kv_blocks, split_kv_blocks, window_spec
from deepinfer.environment import resolve_model
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.model.kv_layout import (
    KVCaches,
    allocate_kv_caches,
    full_layer_caches,
    kv_bytes_per_block,
)
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.loading.loader import LoadedModel, load_model
from deepinfer.model.mtp import MTPHead, load_mtp_head
from deepinfer.model.protocol import CausalLM
from deepinfer.runner.cuda_graphs import DecodeGraphs, capture_decode_graphs
from deepinfer.runner.device import resolve_dtype
from deepinfer.runner.device_groups import DeviceGroups
from deepinfer.runner.prefill_graphs import PrefillGraphs, capture_prefill_graphs


@dataclass(frozen=True)
class Replica:
    """One device group's model and the KV pool bound to it."""

    model: CausalLM
    kv_caches: KVCaches
    num_blocks: int
    device: torch.device
    draft: CausalLM | None = None
    """`--speculative draft-model`: the draft, bound to caches of `num_blocks` blocks of its own."""
    window: WindowSpec | None = None
    """The sliding-window layers' KV in a pool of its own (`--window-kv window`), else None."""
    num_window_blocks: int = 0
    mtp: MTPHead | None = None
    """`--speculative mtp`: the model's MTP layer, bound to caches of `num_blocks` blocks."""

    @property
    def window_caches(self) -> KVCaches:
        """The sliding-window layers' caches where they have a pool of their own."""
        if self.window is None:
            return []
        return [kv for i, kv in enumerate(self.kv_caches) if self.model.arch.window(i)]

    @property
    def tier_caches(self) -> KVCaches:
        """The caches a block's payload in the host and disk tiers covers."""
        return full_layer_caches(self.model.arch, self.kv_caches, self.window is not None)


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


def build_replicas(
    config: Config,
    path: Path,
    groups: DeviceGroups,
    tensor_parallel: tuple[int, int] | None = None,
) -> Replicas:
    """The prefill group's model and pool, and the decode group's when it is separate
    (`tensor_parallel`: (rank, world), this rank's shard of the model and of every block)."""
    dtype = resolve_dtype(config.model.dtype, groups.prefill)
    loaded = load(config, path, dtype, groups.prefill, tensor_parallel=tensor_parallel)
    backend = loaded.model.attention_backend.name
    kv_dtype = kv_cache_dtype(config.cache, dtype, backend, groups.prefill)
    draft = load_draft(config, loaded, groups.decode)
    split = groups.split
    mtp = load_mtp(config, loaded, path, split)
    prefill = build_replica(
        config, loaded, loaded.model, kv_dtype, groups.prefill, None if split else draft, split,
        mtp,
    )  # fmt: skip
    decode = prefill
    if split:
        decode_model = load(config, path, dtype, groups.decode).model
        decode = build_replica(config, loaded, decode_model, kv_dtype, groups.decode, draft, split)
    return Replicas(loaded, prefill, decode, kv_dtype)


def load_draft(config: Config, loaded: LoadedModel, device: torch.device) -> LoadedModel | None:
    """The draft model for `--speculative draft-model` (else None), on the decode group's
    device; refused unless its vocabulary is the model's."""
    path = config.speculative.draft_model
    if config.speculative.speculative != "draft-model":
        return None
    if path is None:
        raise ConfigError("--speculative draft-model needs --draft-model PATH")
    draft = load(config, resolve_model(Path(path)), loaded.dtype, device, draft=True)
    tokens, draft_tokens = _vocab(loaded), _vocab(draft)
    same_tokens = tokens is None or draft_tokens is None or tokens == draft_tokens
    if draft.arch.vocab_size != loaded.arch.vocab_size or not same_tokens:
        raise ConfigError(
            f"the draft model {path} has another vocabulary than the model's "
            f"({draft.arch.vocab_size} vs {loaded.arch.vocab_size} tokens)"
        )
    return draft


def load_mtp(config: Config, loaded: LoadedModel, path: Path, split: bool) -> MTPHead | None:
    """The model's MTP layer for `--speculative mtp` (else None); refused with separate device
    groups (the prompt's hidden states stay on the prefill group) and for a model without one.
    `auto` loads it where it can (one device group, a model directory that has one)."""
    method = config.speculative.speculative
    if method == "auto":
        has = path.is_dir() and loaded.arch.num_mtp_layers > 0
        if not has or split or not isinstance(loaded.model, LlamaForCausalLM):
            return None
    elif method != "mtp":
        return None
    if split:
        raise ConfigError(
            "--speculative mtp needs one device group (the same --prefill-devices and "
            "--decode-devices): the decode group does not see the prompt's hidden states"
        )
    if not isinstance(loaded.model, LlamaForCausalLM) or not loaded.arch.num_mtp_layers:
        raise ConfigError(
            f"--speculative mtp: {path} has no multi-token-prediction layer "
            "(DeepSeek-V3's num_nextn_predict_layers, in a model directory)"
        )
    try:
        return load_mtp_head(loaded.model, path)
    except ModelLoadError as exc:
        raise ConfigError(f"--speculative mtp: {exc}") from exc


def _vocab(loaded: LoadedModel) -> list[bytes] | None:
    """A GGUF file's token strings (None for a model directory: its size alone is compared)."""
    reader = loaded.gguf_reader
    if reader is None:
        return None
    field = reader.get_field("tokenizer.ggml.tokens")
    return None if field is None else [bytes(field.parts[i]) for i in field.data]


def load(
    config: Config,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    draft: bool = False,
    tensor_parallel: tuple[int, int] | None = None,
) -> LoadedModel:
    """The model at `path` as the config serves it (a draft model: never batch invariant, its
    arithmetic decides only which tokens are tried; `tensor_parallel`: one rank's shard)."""
    m = config.model
    backend = config.runtime.attention_backend
    return load_model(
        path,
        dtype,
        device,
        backend,
        m.quantized_matmul,
        m.matmul_activations,
        batch_invariant=m.batch_invariant and not draft,
        bf16_prefill="off" if m.batch_invariant and not draft else m.bf16_prefill,
        tensor_parallel=tensor_parallel,
    )


def build_replica(
    config: Config,
    loaded: LoadedModel,
    model: CausalLM,
    kv_dtype: torch.dtype,
    device: torch.device,
    draft: LoadedModel | None = None,
    split: bool = False,
    mtp: MTPHead | None = None,
) -> Replica:
    """A KV pool on `device`, sized by the cache config and bound to `model` (and `draft`:
    each block holds both models' KV)."""
    block_size, arch = config.cache.block_size, loaded.arch
    spec = window_spec(config, arch, split)
    num_window_blocks = 0
    if spec is not None:
        n_w = spec.num_windowed_layers
        full_bytes = kv_bytes_per_block(arch, block_size, kv_dtype, arch.num_layers - n_w)
        window_bytes = kv_bytes_per_block(arch, block_size, kv_dtype, n_w)
        num_blocks, num_window_blocks = split_kv_blocks(
            config, spec, full_bytes, window_bytes, device
        )
    else:
        block_bytes = kv_bytes_per_block(arch, block_size, kv_dtype)
        if draft is not None:
            block_bytes += kv_bytes_per_block(draft.arch, block_size, kv_dtype)
        if mtp is not None:
            block_bytes += kv_bytes_per_block(mtp.arch, block_size, kv_dtype)
        num_blocks = num_kv_blocks(config.cache, block_bytes, device)
    kv_caches = allocate_kv_caches(
        arch, num_blocks, block_size, kv_dtype, device, num_window_blocks
    )
    model.bind_kv_caches(kv_caches)
    if draft is not None:
        draft.model.bind_kv_caches(
            allocate_kv_caches(draft.arch, num_blocks, block_size, kv_dtype, device)
        )
    if mtp is not None:
        mtp.bind_kv_caches(allocate_kv_caches(mtp.arch, num_blocks, block_size, kv_dtype, device))
    draft_model = draft.model if draft else None
    return Replica(model, kv_caches, num_blocks, device, draft_model, spec, num_window_blocks, mtp)


def capture_graphs(config: Config, decode: Replica, max_len: int) -> DecodeGraphs | None:
    """The decode group's CUDA graphs per `--cuda-graphs` (None: eager decode; so too with a
    windowed pool of its own, whose tables the captured graphs do not take, and for a Mixture
    of Experts, whose experts' row counts change every step)."""
    if decode.window is not None:
        if config.runtime.cuda_graphs == "on":
            raise ConfigError("--cuda-graphs on needs --window-kv all for this model")
        return None
    if decode.model.arch.moe is not None:
        if config.runtime.cuda_graphs == "on":
            raise ConfigError("--cuda-graphs on: Mixture-of-Experts models decode eagerly")
        return None
    max_blocks = -(-max_len // config.cache.block_size)
    return capture_decode_graphs(
        config.runtime.cuda_graphs,
        decode.model,
        decode.device,
        config.scheduler.max_num_seqs,
        max_blocks,
    )


def capture_prefill(config: Config, prefill: Replica) -> PrefillGraphs | None:
    """The prefill group's piecewise CUDA graphs per `--cuda-graphs`, one set per token bucket
    up to a step's token budget (None: eager prefill)."""
    return capture_prefill_graphs(
        config.runtime.cuda_graphs,
        prefill.model,
        prefill.device,
        config.scheduler.max_num_batched_tokens,
    )
