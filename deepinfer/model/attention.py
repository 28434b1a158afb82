"""Kernel backends for the forward pass, chosen once at start-up.

`torch` runs the kernels' plain-torch `*_reference` functions (the CPU path). `triton` runs the
Triton launchers (same signatures, named without `_reference`); a launcher that does not exist
yet falls back to its reference, announced in one log line. Only `triton_backend` imports the
launcher modules, so the other backends never load Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.errors import ConfigError
from deepinfer.kernels.attention.paged_attention_torch import PagedAttentionPlan
from deepinfer.kernels.dispatch import run_or_fallback
from deepinfer.kernels.native.cpu_native import (
    NativeUnavailableError,
    native_available,
    native_library,
)

logger = logging.getLogger(__name__)

# op name -> (module of its torch reference `<op>_reference`, module of its Triton launcher
# `<op>`, None where there is none). Only the launcher modules import Triton.
_OPS: dict[str, tuple[str, str | None]] = {
    "rms_norm": ("elementwise.norm_torch", "elementwise.norm"),
    "fused_add_rms_norm": ("elementwise.norm_torch", "elementwise.norm"),
    "apply_rotary": ("elementwise.rotary_torch", "elementwise.rotary"),
    "store_kv": ("attention.kv_store_torch", "attention.kv_store"),
    "silu_mul": ("elementwise.activation", None),
    "gelu_tanh_mul": ("elementwise.activation", None),
    "paged_decode_attention": ("attention.paged_attention_torch", "attention.paged_attention"),
    "paged_prefill_attention": ("attention.paged_attention_torch", "attention.paged_attention"),
    "plan_paged_attention": ("attention.paged_attention_torch", "attention.paged_attention"),
}


class AttentionBackend(Protocol):
    """The kernels one forward pass calls; signatures are those of `deepinfer.kernels`."""

    @property
    def name(self) -> str: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> None: ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        plan: PagedAttentionPlan | None = None,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        plan: PagedAttentionPlan | None = None,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def plan_paged_attention(
        self,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        k_cache: torch.Tensor,
    ) -> PagedAttentionPlan | None:
        """Once per step: what every layer's attention shares (None: the backend needs none)."""
        ...


@dataclass(frozen=True)
class KernelBackend:
    """An `AttentionBackend` made of plain functions, one per op."""

    name: str
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., None]
    store_kv: Callable[..., None]
    silu_mul: Callable[..., torch.Tensor]
    gelu_tanh_mul: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    plan_paged_attention: Callable[..., PagedAttentionPlan | None]


def _kernel_module(name: str):
    return importlib.import_module(f"deepinfer.kernels.{name}")


def _references() -> dict[str, Callable]:
    return {op: getattr(_kernel_module(mod), f"{op}_reference") for op, (mod, _) in _OPS.items()}


def torch_backend() -> KernelBackend:
    return KernelBackend(name="torch", **_references())


def triton_backend(batch_invariant: bool = False) -> KernelBackend:
    """Triton launchers where the kernel modules define them, references elsewhere. Imports the
    launcher modules (and so Triton): `TRITON_INTERPRET=1`, for CPU tensors, must be set first.
    With `batch_invariant`, every query's attention goes through the decode kernel, one row
    each (`paged_prefill_attention_rows`), and attention never falls back to torch (whose sums'
    order depends on the batch): a shape the kernels do not take is an error."""
    ops = _references()
    missing: list[str] = []
    for op, (_, launcher_mod) in _OPS.items():
        launcher = getattr(_kernel_module(launcher_mod), op, None) if launcher_mod else None
        if launcher is None:
            missing.append(op)
        else:  # shapes a kernel does not cover fall back to torch, logged once
            ops[op] = functools.partial(run_or_fallback, op, launcher, ops[op])
    if missing:
        logger.info(
            "triton backend: no launcher for %s; using torch references", ", ".join(missing)
        )
    if batch_invariant:
        attention = _kernel_module("attention.paged_attention")
        ops["paged_decode_attention"] = attention.paged_decode_attention
        ops["paged_prefill_attention"] = attention.paged_prefill_attention_rows
    return KernelBackend(name="triton", **ops)


def cpu_backend(batch_invariant: bool = False) -> KernelBackend:
    """The torch references, with decode attention (and short prompt chunks), the norms,
    rotary, the KV store, silu * up and gelu_tanh * up through the native CPU kernels; with
    `batch_invariant`, every query's attention through the native kernel, one row each (their
    per-row order is fixed: no reduction depends on the other rows, the chunking or the thread
    count)."""
    from deepinfer.kernels.attention import paged_attention_cpu as cpu
    from deepinfer.kernels.elementwise import elementwise_cpu as ew

    ops = _references()
    ops["rms_norm"] = ew.rms_norm_cpu
    ops["fused_add_rms_norm"] = ew.fused_add_rms_norm_cpu
    ops["apply_rotary"] = ew.apply_rotary_cpu
    ops["store_kv"] = ew.store_kv_cpu
    ops["silu_mul"] = ew.silu_mul_cpu
    ops["gelu_tanh_mul"] = ew.gelu_tanh_mul_cpu
    ops["plan_paged_attention"] = functools.partial(
        cpu.plan_paged_attention_cpu, every_row=batch_invariant
    )
    ops["paged_decode_attention"] = cpu.paged_decode_attention_cpu
    ops["paged_prefill_attention"] = cpu.paged_prefill_attention_cpu
    return KernelBackend(name="cpu", **ops)


BF16_ATTENTION_FROM = 1024
"""Context length from which the cpu backend's prefill chunks attend in bf16 where bf16 is fast
(shorter contexts cost little attention either way)."""


def with_bf16_long_prefill(backend: AttentionBackend) -> AttentionBackend:
    """The cpu backend with prefill chunks of `BF16_ATTENTION_FROM` tokens of context or more
    attending in bf16 (`attend_multi_token_queries`); other backends unchanged."""
    if not isinstance(backend, KernelBackend) or backend.name != "cpu":
        return backend
    op = functools.partial(backend.paged_prefill_attention, bf16_from=BF16_ATTENTION_FROM)
    return dataclasses.replace(backend, paged_prefill_attention=op)


def _batch_invariant_backend(name: str, device: torch.device) -> KernelBackend:
    """The cpu backend on CPU (the native kernels, every query one row), the triton one on CUDA
    (or on CPU under the Triton interpreter, when asked for by name): their attention sums in
    an order fixed per row. torch's does not."""
    if device.type == "cuda" and name in ("auto", "triton"):
        if not _triton_available():
            raise ConfigError("--batch-invariant on CUDA needs the triton package installed")
        return triton_backend(batch_invariant=True)
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return triton_backend(batch_invariant=True)
    if name not in ("auto", "cpu") or device.type != "cpu" or not native_available():
        where = f"the {name} attention backend on {device.type}"
        raise ConfigError(
            f"--batch-invariant runs on the native CPU kernels (attention backend cpu or auto, "
            f"on CPU, with the kernels built) or on the Triton kernels (triton or auto, on "
            f"CUDA), not {where}"
        )
    return cpu_backend(batch_invariant=True)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_attention_backend(
    name: str, device: torch.device, *, batch_invariant: bool = False
) -> KernelBackend:
    """Pick the backend once: `auto` is triton on CUDA when triton is importable, cpu on CPU
    when the native kernels build, else torch. `batch_invariant` takes the cpu backend on CPU
    and the triton one on CUDA (torch's prompt attention sums in an order that depends on the
    chunk)."""
    if batch_invariant:
        return _batch_invariant_backend(name, device)
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_available() else "torch"
        else:
            name = "cpu" if device.type == "cpu" and native_available() else "torch"
    if name == "torch":
        return torch_backend()
    if name == "cpu":
        if device.type != "cpu":
            raise ConfigError(f"attention backend 'cpu' runs on CPU, not {device.type}")
        try:
            native_library()
        except NativeUnavailableError as exc:
            raise ConfigError(f"attention backend 'cpu' cannot run here: {exc}") from exc
        return cpu_backend()
    if name == "triton":
        if not _triton_available():
            raise ConfigError("attention backend 'triton' needs the triton package installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"attention backend 'triton' on {device.type} needs TRITON_INTERPRET=1; "
                "use 'torch' or 'auto' instead"
            )
        return triton_backend()
    raise ConfigError(f"unknown attention backend {name!r}; choose auto, cpu, torch or triton")
