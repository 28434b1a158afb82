"""A Llama-family decoder stack in one native call (`cpu/llama_layers.c`), for the `cpu` backend.

The C driver calls the same kernels, with the same arguments and in the same order, as the
Python forward does through the backend ops one by one, so its output is bit-identical; it only
saves the ~13 Python calls a layer (most of a one-stream decode step's time). Each layer brings
what sets it apart (`LayerWeights`): its RoPE table and sliding window, per-head q/k norms
(Qwen3, Gemma 3), norms of its attention and MLP outputs and a gelu_tanh gate (Gemma 3).
`NativeLayerStack` is built once per model and KV pool where everything qualifies (quantized
matmuls without biases, caches the native attention reads, shapes the kernels take) and raises
`ValueError` saying why not otherwise; `step_applies` says whether a step's attention plan is
entirely native (every query one row of the decode kernel).

The sliding-window layers may keep their KV in a paged pool of their own (caches of another
number of blocks, addressed by a slot mapping and block tables of their own): `run` then takes
that pool's slot mapping and attention plan next to the full layers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from ..attention.paged_attention_cpu import MAX_GROUP, MAX_HEAD_DIM, NATIVE_KV_DTYPES
from ..attention.paged_attention_torch import PagedAttentionPlan
from ..linear.fixed_sum import FixedSumWeight
from ..linear.int8_matmul import BlockWeight, FixedOrderWeight, Int8PackedWeight
from ..native.cpu_abi import LlamaLayer, LlamaStep, Matrix
from ..native.cpu_native import native_library


class Activation(IntEnum):
    """The MLP's gate activation: DI_ACT_* of cpu/deepinfer_kernels.h."""

    SILU = 0
    GELU_TANH = 1


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the native stack reads it: the computation of `LlamaDecoderLayer`,
    plus Gemma 3's where its optional fields are set."""

    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight
    input_norm: torch.Tensor  # float32 [hidden]
    post_norm: torch.Tensor
    """The MLP's input norm (fused with the residual add of the attention output)."""
    k_cache: torch.Tensor  # [N, S, Hkv, D] float32 or float16, contiguous
    v_cache: torch.Tensor
    cos_sin: torch.Tensor  # [P, D] float32
    """This layer's RoPE table (a windowed layer's may have a base of its own)."""
    window: int = 0
    """The sliding window its queries attend, 0 for every key."""
    activation: Activation = Activation.SILU
    q_norm: torch.Tensor | None = None  # float32 [D]
    """Per-head RMSNorm of q before rotary (with `k_norm`)."""
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # float32 [hidden]
    """RMSNorm of the attention output before it joins the residual stream."""
    mlp_out_norm: torch.Tensor | None = None
    """RMSNorm of the MLP output before it joins the residual stream."""
    qkv_bias: torch.Tensor | None = None  # float32 [q + 2 kv rows]
    """Added to the q/k/v projection's output (Qwen2)."""


@dataclass(frozen=True)
class StackShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def matrix(w: BlockWeight, out_features: int, in_features: int) -> Matrix:
    """`w` as the native calls read it (ValueError where no native kernel serves it)."""
    if isinstance(w, FixedOrderWeight | FixedSumWeight):
        raise ValueError("a float matrix (a fixed-order matmul's) is no native kernel's")
    if (w.out_features, w.in_features) != (out_features, in_features):
        raise ValueError(
            f"a {w.out_features}x{w.in_features} matrix where {out_features}x{in_features} belongs"
        )
    if isinstance(w, Int8PackedWeight):
        fmt2, rows2 = w.second
        return Matrix(
            w.packed.data_ptr(), int(w.fmt), 1, out_features, in_features, int(fmt2), rows2
        )
    return Matrix(w.blocks.data_ptr(), int(w.fmt), 0, out_features, in_features, int(w.fmt), 0)


def _check_shape(s: StackShape) -> None:
    if s.hidden % 8 or s.intermediate % 8:
        raise ValueError("hidden and intermediate sizes must be multiples of 8")
    if s.head_dim % 16 or s.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head size {s.head_dim} is not one the attention kernel takes")
    if s.num_heads % s.num_kv_heads or s.num_heads // s.num_kv_heads > MAX_GROUP:
        raise ValueError(f"{s.num_heads} query heads over {s.num_kv_heads} KV heads")


def _check_caches(layer: LayerWeights, s: StackShape) -> None:
    k, v = layer.k_cache, layer.v_cache
    if k.device.type != "cpu" or k.dtype not in NATIVE_KV_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"KV caches of {k.dtype} on {k.device}")
    if k.shape != v.shape or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("K and V caches must be contiguous and of one shape")
    if k.dim() != 4 or tuple(k.shape[2:]) != (s.num_kv_heads, s.head_dim):
        raise ValueError(f"KV cache shape {tuple(k.shape)}")


@dataclass(frozen=True)
class _Pool:
    """The caches of one group of layers (the full ones, or the windowed ones): one shape."""

    num_slots: int
    block_size: int
    dtype: torch.dtype


def _pool(layers: Sequence[LayerWeights], kind: str) -> _Pool | None:
    """The pool `layers` share (None for no layers); ValueError unless every cache is of one
    shape and dtype, as the native step addresses each pool with one slot mapping."""
    if not layers:
        return None
    k0 = layers[0].k_cache
    if any(x.k_cache.shape != k0.shape or x.k_cache.dtype != k0.dtype for x in layers):
        raise ValueError(f"the {kind} layers' KV caches must share one shape and dtype")
    return _Pool(k0.shape[0] * k0.shape[1], k0.shape[1], k0.dtype)


def _vector(w: torch.Tensor | None, size: int) -> int:
    """A norm weight's address (0 for none); ValueError unless contiguous float32 [size]."""
    if w is None:
        return 0
    if w.dtype != torch.float32 or not w.is_contiguous() or w.shape != (size,):
        raise ValueError(f"norm weights must be contiguous float32 [{size}]")
    return w.data_ptr()


def _check_table(cos_sin: torch.Tensor, s: StackShape) -> None:
    if (
        cos_sin.dtype != torch.float32
        or not cos_sin.is_contiguous()
        or cos_sin.dim() != 2
        or cos_sin.shape[1] != s.head_dim
    ):
        raise ValueError("a rotary table must be contiguous float32 [P, head_dim]")


def _layer_struct(layer: LayerWeights, s: StackShape) -> LlamaLayer:
    _check_caches(layer, s)
    _check_table(layer.cos_sin, s)
    if layer.window < 0:
        raise ValueError(f"a window of {layer.window} keys")
    width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    matrices = (
        matrix(layer.qkv, width, s.hidden),
        matrix(layer.o, s.hidden, s.num_heads * s.head_dim),
        matrix(layer.gate_up, 2 * s.intermediate, s.hidden),
        matrix(layer.down, s.hidden, s.intermediate),
    )
    norms = (
        _vector(layer.input_norm, s.hidden),
        _vector(layer.post_norm, s.hidden),
        _vector(layer.q_norm, s.head_dim),
        _vector(layer.k_norm, s.head_dim),
        _vector(layer.attn_out_norm, s.hidden),
        _vector(layer.mlp_out_norm, s.hidden),
    )
    qkv_bias = _vector(layer.qkv_bias, width)
    return LlamaLayer(
        *matrices, *norms, layer.cos_sin.data_ptr(), layer.window, int(layer.activation),
        layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), qkv_bias,
    )  # fmt: skip


class NativeLayerStack:
    """Every decoder layer of one model, over one KV pool or (the sliding-window layers' KV
    apart) two, as one native call a step."""

    def __init__(self, layers: Sequence[LayerWeights], shape: StackShape):
        _check_shape(shape)
        if not layers:
            raise ValueError("a stack of no layers")
        structs = [_layer_struct(layer, shape) for layer in layers]
        if len({layer.cos_sin.shape[0] for layer in layers}) != 1:
            raise ValueError("the layers' rotary tables must cover the same positions")
        full = _pool([x for x in layers if x.window == 0], "full")
        windowed = _pool([x for x in layers if x.window > 0], "windowed")
        pools = [p for p in (full, windowed) if p is not None]
        if len({(p.block_size, p.dtype) for p in pools}) != 1:
            raise ValueError("the full and windowed layers' caches must share block size and dtype")
        self.shape = shape
        self._layers = (LlamaLayer * len(structs))(*structs)
        self._layers_kept = list(layers)  # the memory the pointers point into
        self._num_positions = layers[0].cos_sin.shape[0]
        self._block_size = pools[0].block_size
        self._kv_f16 = int(pools[0].dtype == torch.float16)
        self._num_slots = pools[0].num_slots
        """The pool every layer uses without a window pool: the full layers' where there are."""
        self._window_num_slots = windowed.num_slots if windowed is not None else 0
        self._pools_differ = windowed is not None and windowed.num_slots != self._num_slots
        """Then a step must address the windowed layers' pool: the full one's slots overrun it."""
        self._lib = native_library()

    def run(
        self,
        h: torch.Tensor,  # [T, hidden] float32: the embeddings (not modified)
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        plan: PagedAttentionPlan,
        window_slot_mapping: torch.Tensor | None = None,  # [T] int64
        window_plan: PagedAttentionPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it), as the Python layers
        return them; the caller has checked `step_applies(plan, ..., window_plan)`. With
        `window_slot_mapping` and `window_plan` (both or neither), the sliding-window layers
        store and read their KV through those (their own pool's), the full layers through
        `slot_mapping` and `plan`; without, every layer through the latter."""
        native = plan.native
        assert native is not None and native.rows is None, "a step the stack does not take"
        tokens = h.shape[0]
        for t, dtype in ((positions, torch.int64), (slot_mapping, torch.int64)):
            if t.dtype != dtype or not t.is_contiguous() or t.shape != (tokens,):
                raise ValueError("positions and slots must be contiguous int64 [T]")
        if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != self.shape.hidden:
            raise ValueError(f"hidden states {h.dtype} {tuple(h.shape)}")
        out = h.contiguous().clone()
        residual = torch.empty_like(out)
        tables, lens = native.block_tables, native.context_lens
        window = self._window_fields(tokens, tables, window_slot_mapping, window_plan)
        s = self.shape
        step = LlamaStep(
            tokens, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            s.eps, s.scale, positions.data_ptr(), self._num_positions,
            slot_mapping.data_ptr(), self._num_slots,
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), self._block_size,
            self._kv_f16, torch.get_num_threads(), *window,
        )  # fmt: skip
        self._lib.llama_layers(self._layers, step, out.data_ptr(), residual.data_ptr())
        return out, residual

    def _window_fields(
        self,
        tokens: int,
        tables: torch.Tensor,  # the full layers' [T, max_blocks] int32
        slot_mapping: torch.Tensor | None,
        plan: PagedAttentionPlan | None,
    ) -> tuple[int, int, int, int]:
        """The step's (window_slots, window_num_slots, window_block_tables, window_max_blocks):
        the windowed layers' pool, or zeros (NULL: every layer in the full layers' pool)."""
        if (slot_mapping is None) != (plan is None):
            raise ValueError("the windowed layers' pool needs both its slot mapping and plan")
        if slot_mapping is None or plan is None:
            if self._pools_differ:
                raise ValueError("the windowed layers keep a pool of their own: pass its slots")
            return 0, 0, 0, 0
        native = plan.native
        assert native is not None and native.rows is None, "a step the stack does not take"
        if (
            slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()
            or slot_mapping.shape != (tokens,)
        ):
            raise ValueError("window slots must be contiguous int64 [T]")
        window_tables = native.block_tables
        if (
            window_tables.dtype != torch.int32
            or not window_tables.is_contiguous()
            or window_tables.dim() != 2
            or window_tables.shape[0] != tables.shape[0]
        ):
            raise ValueError("window block tables must be contiguous int32 [T, max_blocks]")
        return (
            slot_mapping.data_ptr(), self._window_num_slots,
            window_tables.data_ptr(), window_tables.shape[1],
        )  # fmt: skip


def _plan_applies(plan: PagedAttentionPlan | None, num_tokens: int) -> bool:
    return (
        plan is not None
        and plan.native is not None
        and plan.native.rows is None
        and len(plan.single_query) == len(plan.context_lens)
        and plan.native.context_lens.shape[0] == num_tokens
    )


def step_applies(
    plan: PagedAttentionPlan | None,
    num_tokens: int,
    window_plan: PagedAttentionPlan | None = None,
) -> bool:
    """Whether every query of the step is one row of the native attention kernel, in order:
    in `plan`, and in `window_plan` (the windowed layers' pool's) where one is given."""
    return _plan_applies(plan, num_tokens) and (
        window_plan is None or _plan_applies(window_plan, num_tokens)
    )
