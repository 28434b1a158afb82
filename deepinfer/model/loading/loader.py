"""`load_model`: the one entry point from a weights path to a ready model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import gguf
import torch

from deepinfer.environment import machine_cache_dir
from deepinfer.errors import ModelLoadError
from deepinfer.kernels.linear.bf16_probe import VERDICT_FILE, Bf16Probe
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import select_attention_backend, with_bf16_long_prefill
from deepinfer.model.loading.fingerprint import directory_digest, file_digest, kv_fingerprint
from deepinfer.model.loading.gguf_loader import (
    KERNEL_FORMAT_NAMES,
    GGUFTensorSource,
    gguf_arch,
    open_gguf,
    release_mapped_pages,
)
from deepinfer.model.loading.quantized import (
    Served,
    float_matrices,
    int8_activations_wanted,
    probe_verdict,
    quantize_linears,
    quantized_matmul_wanted,
    serve_fixed_order,
    serve_long_rows_bf16,
    serve_routers_fixed_sum,
)
from deepinfer.model.loading.safetensors_loader import open_safetensors_dir
from deepinfer.model.loading.sharding import ShardedSource, local_arch, shard_plan
from deepinfer.model.loading.weights import TensorSource, build_state_dict
from deepinfer.model.null_model import is_null_model, open_null_model
from deepinfer.model.protocol import CausalLM
from deepinfer.model.registry import get_model_class


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    """In eval mode; call `model.bind_kv_caches(...)` before the first forward."""
    arch: ModelArch
    path: Path
    dtype: torch.dtype
    device: torch.device
    weights_digest: str
    """sha256 identity of the weights file(s); see deepinfer.model.loading.fingerprint."""
    gguf_reader: gguf.GGUFReader | None
    """The open reader for GGUF files (the tokenizer is built from its metadata); else None."""
    quantized_bytes: int = 0
    """Bytes of matrices served in GGUF blocks by the native kernel (0: all fp32)."""
    int8_activations: bool = False
    """The quantized kernel quantizes activations to int8 (integer dot products)."""
    batch_invariant: bool = False
    """Every row's arithmetic is independent of the step it runs in (`--batch-invariant`)."""
    bf16_prefill: bool = False
    """Long products by the int8-served matrices run as bf16 tiles (`--bf16-prefill`)."""


def _open(path: Path) -> tuple[ModelArch, TensorSource, str, gguf.GGUFReader | None]:
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        arch, source = open_safetensors_dir(path)
        return arch, source, directory_digest(path / "config.json", source.files), None
    reader = open_gguf(path)
    arch = gguf_arch(reader)
    return arch, GGUFTensorSource(reader, arch), file_digest(path), reader


def read_arch(path: Path) -> ModelArch:
    """A model's shape from its metadata alone (no weights read, no digest)."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return open_safetensors_dir(path)[0] if path.is_dir() else gguf_arch(open_gguf(path))


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "auto",
    quantized_matmul: str = "auto",
    matmul_activations: str = "float32",
    *,
    batch_invariant: bool = False,
    bf16_prefill: str = "off",
    tensor_parallel: tuple[int, int] | None = None,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory; raise ModelLoadError on any bad input.

    `quantized_matmul` (`auto|on|off`): serve a GGUF file's block-quantized matrices (Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) in their blocks through the native CPU kernel (see deepinfer.model.loading.quantized); `matmul_activations`
    (`auto|float32|int8`): what that kernel multiplies them by. `batch_invariant`: every row's
    arithmetic independent of the step it runs in (see `check_batch_invariant`).
    `bf16_prefill` (`auto|on|off`): int8-served matrices take long products as bf16 tiles,
    and long-context prefill chunks attend in bf16 (`auto`: attention where `Bf16Probe` finds
    bf16 matmuls fast, tiles for the block formats where it finds them faster than the int8
    kernel; never when batch invariant). `tensor_parallel` (rank, world): load that
    rank's shard alone (`sharding.py`), its model's `arch` the shard's.

    Blocking (seconds): call it from an executor when an event loop is running.
    """
    path = Path(path)
    device = torch.device(device)
    # fail fast, before parsing
    backend = select_attention_backend(attention_backend, device, batch_invariant=batch_invariant)
    if is_null_model(path):
        null, arch, digest, vocabulary = open_null_model(path, device, backend)
        return LoadedModel(null, arch, path, dtype, device, digest, vocabulary)
    arch, full_source, weights_digest, reader = _open(path)
    wanted = isinstance(full_source, GGUFTensorSource) and quantized_matmul_wanted(
        quantized_matmul, device, dtype
    )
    source: TensorSource = full_source
    if tensor_parallel is not None:  # (rank, world): this rank's heads and FFN features alone
        shard = shard_plan(arch, tensor_parallel[1], tensor_parallel[0])
        source, arch = ShardedSource(full_source, arch, shard), local_arch(arch, shard)
    model = get_model_class(arch.architecture)(arch, device=device, backend=backend)
    int8 = int8_activations_wanted(matmul_activations, wanted)
    probe = (
        Bf16Probe.shared(machine_cache_dir() / VERDICT_FILE)
        if int8 and bf16_prefill == "auto" and not batch_invariant
        else None
    )
    served = Served(0, frozenset())
    if wanted:  # first: those are never dequantized
        assert isinstance(source, GGUFTensorSource | ShardedSource)
        served = quantize_linears(model, source, arch.num_layers, int8)
    state = build_state_dict(
        arch, source, dtype, device, desc=f"loading {path.name}", served=served.sources
    )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # shape mismatches between metadata and tensors
        raise ModelLoadError(f"{path}: tensors do not match the model's metadata: {exc}") from exc
    model.eval()
    if reader is not None:
        release_mapped_pages(reader)
    quantized = served.nbytes
    verdict = probe_verdict(probe) if probe is not None else None  # (int8, auto)
    tiled = attention = int8 and bf16_prefill == "on"
    if tiled:  # asked for: every format
        serve_long_rows_bf16(model)
    elif verdict is not None:
        tiled = serve_long_rows_bf16(model, verdict.tiles) > 0
        attention = verdict.attention
    if attention:
        causal = cast(CausalLM, model)
        causal.set_attention_backend(with_bf16_long_prefill(backend))
    tiles = tiled or attention
    if int8 and not quantized:
        raise ModelLoadError(
            f"--matmul-activations int8: {path} has no matrices in a format the quantized "
            f"matmul takes ({', '.join(KERNEL_FORMAT_NAMES)})"
        )
    if batch_invariant and backend.name == "triton":
        serve_fixed_order(model)  # cuBLAS's sums depend on the shape: the fixed-order matmul
    elif batch_invariant:
        serve_routers_fixed_sum(model)
        check_batch_invariant(model, path)
    causal_lm: CausalLM = model  # type: ignore[assignment]
    return LoadedModel(
        causal_lm, arch, path, dtype, device, weights_digest, reader, quantized, int8,
        batch_invariant, tiles,
    )  # fmt: skip


def check_batch_invariant(model: torch.nn.Module, path: Path) -> None:
    """On the cpu backend, refuse a model some of whose matrices BLAS would multiply: its sums'
    order, and so its bits, depend on how many rows the step has. The quantized kernel's do not
    (each output is the same sum in the same order whatever the rows), nor do the native
    attention kernel's (the backend takes every query as one row) or the per-row norms. (The
    triton backend serves every matrix through its fixed-order matmul instead.)"""
    left = float_matrices(model)
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        raise ModelLoadError(
            f"--batch-invariant needs every matrix served by the quantized CPU kernel (a GGUF "
            f"file with {'/'.join(KERNEL_FORMAT_NAMES)} matrices, float32 on CPU, "
            f"--quantized-matmul auto or on); "
            f"{path.name} would multiply {shown} in float"
        )


def model_fingerprint(
    loaded: LoadedModel,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
    full_layers_only: bool = False,
) -> str:
    """sha256 hex digest of weights identity + serving dtype + KV layout: seeds prefix-cache keys.
    `full_layers_only`: a block's payload holds the full-attention layers alone (the windowed
    ones keep their own pool)."""
    a = loaded.arch
    # the quantized kernel sums in another order than BLAS: KV from one is not the other's
    numerics = f"{dtype}+quantized-matmul" if loaded.quantized_bytes else str(dtype)
    if loaded.int8_activations:  # and rounds the activations
        numerics += "+int8-activations"
    if kv_dtype is not None and kv_dtype != dtype:
        numerics += f"+kv-{kv_dtype}"
    if loaded.batch_invariant:  # prompts attended row by row: other bits than chunked prefill
        numerics += "+batch-invariant"
    if full_layers_only:
        numerics += "+full-layers-only"
    return kv_fingerprint(
        loaded.weights_digest, numerics, a.num_layers, a.num_kv_heads, a.head_dim, block_size
    )
