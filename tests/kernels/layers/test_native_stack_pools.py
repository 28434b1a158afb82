"""The native decoder stack (`kernels/cpu/llama_layers.c`) with the sliding-window layers' KV in a
paged pool of their own (caches of another number of blocks, other block ids, slots and tables of
their own): bit-identical hidden states, residual stream and K/V to the same stack over one pool
shared by every layer, for a decode step and a step of short chunks; the full layers skip the
rows whose K/V their pool already holds (slot -1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.kernels.attention.paged_attention_cpu import plan_paged_attention_cpu
from deepinfer.kernels.attention.paged_attention_torch import (
    PagedAttentionPlan,
    plan_paged_attention_reference,
)
from deepinfer.kernels.elementwise.rotary_torch import rotary_cos_sin
from deepinfer.kernels.layers.llama_layers_cpu import (
    LayerWeights,
    NativeLayerStack,
    StackShape,
    step_applies,
)
from deepinfer.kernels.linear.quant_matmul import QuantFormat
from tests.kernels.gguf_weights import gguf_weight, needs_native

pytestmark = needs_native

SHAPE = StackShape(
    hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96, eps=1e-6, scale=0.25
)
WINDOW = 8
WINDOWS = (WINDOW, WINDOW, 0, WINDOW, 0)
"""Each layer's window: Gemma 3's kind of mix, two full layers among windowed ones."""
BLOCK = 4
MAX_BLOCKS = 7
"""Logical blocks a request has: its whole context through both steps."""
FULL_BLOCKS, WINDOW_BLOCKS = 24, 31
"""The two pools' sizes: three requests of MAX_BLOCKS blocks fit in either."""
PRIOR = (13, 6, 21)
"""Each request's keys in the caches before the steps."""
DECODE, CHUNKS = (1, 1, 1), (5, 1, 1)
"""New tokens a request has in each step: a decode step, then a chunk among decodes."""
SKIPPED = 2
"""The chunk step's first rows, whose K/V the full layers' pool already holds."""
Pair = tuple[torch.Tensor, torch.Tensor]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN included), to compare exactly."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _tables(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[3, MAX_BLOCKS] int32: each request's logical blocks on distinct shuffled blocks."""
    blocks = torch.randperm(num_blocks, generator=gen)[: len(PRIOR) * MAX_BLOCKS]
    return blocks.view(len(PRIOR), MAX_BLOCKS).to(torch.int32)


def _slots(tables: torch.Tensor, request: int, positions: range) -> torch.Tensor:
    """The cache rows of a request's `positions` through its block table, int64."""
    p = torch.tensor(list(positions), dtype=torch.int64)
    return tables[request, p // BLOCK].long() * BLOCK + p % BLOCK


def _rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, SHAPE.num_kv_heads, SHAPE.head_dim)


def _nan_caches(num_blocks: int, dtype: torch.dtype) -> Pair:
    """Caches NaN everywhere: a row read that no token wrote poisons the output."""
    shape = (num_blocks, BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim)
    k, v = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    return k, v


def _prior_caches(tables: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> Pair:
    """One layer's caches in the one-pool layout, random K/V at every request's prior keys."""
    pair = _nan_caches(FULL_BLOCKS, dtype)
    for b, n in enumerate(PRIOR):
        slots = _slots(tables, b, range(n))
        for cache in pair:
            rows = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gen)
            _rows(cache)[slots] = rows.to(dtype)
    return pair


def _moved(pair: Pair, tables: torch.Tensor, window_tables: torch.Tensor, ends: list[int]) -> Pair:
    """A windowed layer's caches in a pool of its own: the one-pool `pair`'s keys of each request
    from the first one a window of the steps reads up to its `ends`, at their rows through
    `window_tables`; NaN elsewhere (the keys before no window reads are not this pool's to keep)."""
    moved = _nan_caches(WINDOW_BLOCKS, pair[0].dtype)
    for b, end in enumerate(ends):
        keys = range(max(0, PRIOR[b] + 1 - WINDOW), end)
        for src, dst in zip(pair, moved, strict=True):
            _rows(dst)[_slots(window_tables, b, keys)] = _rows(src)[_slots(tables, b, keys)]
    return moved


def _layer(index: int, window: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> LayerWeights:
    """A random Q8_0 layer over the caches given; a windowed one with q/k norms and a RoPE base
    of its own (Gemma 3's)."""
    gen = torch.Generator().manual_seed(100 + index)
    hidden, inter, dim = SHAPE.hidden, SHAPE.intermediate, SHAPE.head_dim
    width = (SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * dim
    shapes = (
        (width, hidden),
        (hidden, SHAPE.num_heads * dim),
        (2 * inter, hidden),
        (hidden, inter),
    )
    qkv, o, gate_up, down = (
        gguf_weight(QuantFormat.Q8_0, n, k, seed=10 * index + j)[0]
        for j, (n, k) in enumerate(shapes)
    )
    norms = [0.5 + torch.rand(size, generator=gen) for size in (hidden, hidden, dim, dim)]
    table = rotary_cos_sin(dim, 64, 10.0 if window else 1e4)
    return LayerWeights(
        qkv, o, gate_up, down, norms[0], norms[1], k_cache, v_cache, table, window=window,
        q_norm=norms[2] if window else None, k_norm=norms[3] if window else None,
    )  # fmt: skip


def _layers(caches: list[Pair]) -> list[LayerWeights]:
    return [_layer(i, w, k, v) for i, (w, (k, v)) in enumerate(zip(WINDOWS, caches, strict=True))]


def _step(
    tables: torch.Tensor, new: tuple[int, ...], starts: list[int], k_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionPlan]:
    """(positions, slot mapping, the cpu backend's plan) of requests with `new` tokens each
    from `starts` on, through `tables`."""
    positions = [range(s, s + n) for s, n in zip(starts, new, strict=True)]
    slots = torch.cat([_slots(tables, b, p) for b, p in enumerate(positions)])
    query_starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([s + n for s, n in zip(starts, new, strict=True)], dtype=torch.int32)
    plan = plan_paged_attention_cpu(tables, query_starts, lens, k_cache)
    flat = torch.tensor([p for r in positions for p in r], dtype=torch.int64)
    return flat, slots, plan


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_window_pool_of_its_own_is_bit_identical(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    tables, window_tables = _tables(FULL_BLOCKS, gen), _tables(WINDOW_BLOCKS, gen)
    one_pool = [_prior_caches(tables, kv_dtype, gen) for _ in WINDOWS]
    two_pools = [
        _moved(pair, tables, window_tables, list(PRIOR))
        if window
        else (pair[0].clone(), pair[1].clone())
        for pair, window in zip(one_pool, WINDOWS, strict=True)
    ]
    layers = _layers(one_pool)
    stack_a = NativeLayerStack(layers, SHAPE)
    stack_b = NativeLayerStack(
        [
            dataclasses.replace(y, k_cache=k, v_cache=v)
            for y, (k, v) in zip(layers, two_pools, strict=True)
        ],
        SHAPE,
    )
    window_layer = WINDOWS.index(WINDOW)
    starts = [n + 1 for n in PRIOR]
    first = _step(tables, DECODE, list(PRIOR), one_pool[0][0])
    window_first = _step(window_tables, DECODE, list(PRIOR), two_pools[window_layer][0])
    second = _step(tables, CHUNKS, starts, one_pool[0][0])
    window_second = _step(window_tables, CHUNKS, starts, two_pools[window_layer][0])
    for (positions, slots, plan), (_, window_slots, window_plan) in (
        (first, window_first),
        (second, window_second),
    ):
        tokens = positions.shape[0]
        assert step_applies(plan, tokens, window_plan), "a step the stack takes"
        h = torch.randn(tokens, SHAPE.hidden, generator=gen)
        want = stack_a.run(h, positions, slots, plan)
        full_slots = slots
        if tokens > len(PRIOR):  # the chunk's first keys: already in the full layers' pool
            full_slots = slots.clone()
            full_slots[:SKIPPED] = -1
            for window, src, dst in zip(WINDOWS, one_pool, two_pools, strict=True):
                for a, b in zip(src, dst, strict=True):
                    if not window:
                        _rows(b)[slots[:SKIPPED]] = _rows(a)[slots[:SKIPPED]]
        got = stack_b.run(h, positions, full_slots, plan, window_slots, window_plan)
        assert all(x.isfinite().all() for x in want)
        assert all(_same(x, y) for x, y in zip(want, got, strict=True))
        for window, src, dst in zip(WINDOWS, one_pool, two_pools, strict=True):
            for a, b in zip(src, dst, strict=True):
                if window:  # the step's K/V, at the windowed pool's rows of the same keys
                    assert _same(_rows(b)[window_slots], _rows(a)[slots])
    ends = [s + n for s, n in zip(starts, CHUNKS, strict=True)]
    for window, src, dst in zip(WINDOWS, one_pool, two_pools, strict=True):
        expected = _moved(src, tables, window_tables, ends) if window else src
        assert all(_same(a, b) for a, b in zip(expected, dst, strict=True)), "no other row written"


def test_the_pools_are_checked() -> None:
    gen = torch.Generator().manual_seed(9)
    tables, window_tables = _tables(FULL_BLOCKS, gen), _tables(WINDOW_BLOCKS, gen)
    one_pool = [_prior_caches(tables, torch.float32, gen) for _ in WINDOWS]
    layers = _layers(one_pool)
    pair = _moved(one_pool[0], tables, window_tables, list(PRIOR))
    moved = [
        dataclasses.replace(y, k_cache=pair[0], v_cache=pair[1]) if y.window else y for y in layers
    ]
    stack = NativeLayerStack(moved, SHAPE)

    other = dataclasses.replace(layers[0], k_cache=pair[0], v_cache=pair[1])
    with pytest.raises(ValueError, match="windowed layers' KV caches must share"):
        NativeLayerStack([other, *layers[1:]], SHAPE)  # the windowed layers in two pools
    blocks = (WINDOW_BLOCKS * 2, BLOCK // 2, SHAPE.num_kv_heads, SHAPE.head_dim)
    halves = [c.view(blocks) for c in pair]
    halved = [
        dataclasses.replace(y, k_cache=halves[0], v_cache=halves[1]) if y.window else y
        for y in layers
    ]
    with pytest.raises(ValueError, match="block size"):
        NativeLayerStack(halved, SHAPE)

    positions, slots, plan = _step(tables, DECODE, list(PRIOR), one_pool[0][0])
    _, window_slots, window_plan = _step(window_tables, DECODE, list(PRIOR), pair[0])
    h = torch.randn(len(PRIOR), SHAPE.hidden, generator=gen)
    with pytest.raises(ValueError, match="pool of their own"):
        stack.run(h, positions, slots, plan)
    with pytest.raises(ValueError, match="both"):
        stack.run(h, positions, slots, plan, window_slot_mapping=window_slots)
    with pytest.raises(ValueError, match="int64"):
        stack.run(h, positions, slots, plan, window_slots.int(), window_plan)
    past_the_pool = window_slots.clone()
    past_the_pool[1] = WINDOW_BLOCKS * BLOCK
    with pytest.raises(ValueError, match="rejected"):
        stack.run(h, positions, slots, plan, past_the_pool, window_plan)

    starts = torch.arange(len(PRIOR) + 1, dtype=torch.int32)
    lens = torch.tensor([n + 1 for n in PRIOR], dtype=torch.int32)
    torch_plan = plan_paged_attention_reference(window_tables, starts, lens, pair[0])
    assert step_applies(plan, len(PRIOR), window_plan)
    assert not step_applies(plan, len(PRIOR), torch_plan)


def test_full_layers_alone_ignore_the_window_pool() -> None:
    """A stack of full layers only (a prefix of the model's) is handed both pools' slots and
    plans: it stores into and reads its own pool only, as without the windowed pool's."""
    gen = torch.Generator().manual_seed(5)
    tables, window_tables = _tables(FULL_BLOCKS, gen), _tables(WINDOW_BLOCKS, gen)
    one_pool = [_prior_caches(tables, torch.float32, gen) for _ in WINDOWS]
    full = [y for y in _layers(one_pool) if not y.window]
    stack = NativeLayerStack(full, SHAPE)
    positions, slots, plan = _step(tables, DECODE, list(PRIOR), one_pool[0][0])
    _, window_slots, window_plan = _step(window_tables, DECODE, list(PRIOR), one_pool[0][0])
    window_slots[0] = 10**9  # addresses nothing this stack has: never checked, never stored to
    h = torch.randn(len(PRIOR), SHAPE.hidden, generator=gen)
    want = stack.run(h, positions, slots, plan)
    before = [c.clone() for y in full for c in (y.k_cache, y.v_cache)]
    got = stack.run(h, positions, slots, plan, window_slots, window_plan)
    assert all(_same(x, y) for x, y in zip(want, got, strict=True))
    after = [c for y in full for c in (y.k_cache, y.v_cache)]
    assert all(_same(x, y) for x, y in zip(before, after, strict=True))
