"""ForwardBatch assembly, KV cache helpers, backend selection and the registry."""

from __future__ import annotations

import dataclasses
import pickle
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.block_ids import BlockIds
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import select_attention_backend
from deepinfer.model.forward_batch import (
    BatchChunk,
    ForwardBatch,
    build_decode_batch,
    build_forward_batch,
)
from deepinfer.model.kv_layout import allocate_kv_caches, check_kv_caches, kv_bytes_per_block
from deepinfer.model.registry import get_model_class

ARCH = ModelArch(
    architecture="llama",
    num_layers=3,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=50,
    rope_theta=1e4,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def test_build_forward_batch_mixed_chunks() -> None:
    chunks = [
        BatchChunk([7], start_position=5, block_ids=[3, 9]),  # a decode at position 5
        BatchChunk([1, 2, 3, 4, 5], start_position=2, block_ids=[4, 8], sample=False),
        BatchChunk([6, 6], start_position=0, block_ids=[2]),
    ]
    batch = build_forward_batch(chunks, block_size=4)
    assert batch.input_ids.tolist() == [7, 1, 2, 3, 4, 5, 6, 6]
    assert batch.positions.tolist() == [5, 2, 3, 4, 5, 6, 0, 1]
    # slot = block_ids[pos // 4] * 4 + pos % 4, computed by hand
    assert batch.slot_mapping.tolist() == [37, 18, 19, 32, 33, 34, 8, 9]
    assert batch.block_tables.tolist() == [[3, 9], [4, 8], [2, 0]]
    assert batch.block_tables.dtype == torch.int32
    assert batch.query_start_loc.tolist() == [0, 1, 6, 8]
    assert batch.context_lens.tolist() == [6, 7, 2]
    assert batch.logits_indices.tolist() == [0, 7]
    assert not batch.is_decode_only
    assert (batch.num_tokens, batch.num_requests) == (8, 3)


def test_prompt_rows_follow_every_sampling_row() -> None:
    """Prompt rows (prompt logprobs) come after all sampling rows, each chunk's in order, so
    the sampler's rows stay the first `B_sample` whatever else is scored."""
    chunks = [
        BatchChunk([1, 2, 3], start_position=0, block_ids=[1], sample=False, num_prompt_logits=3),
        BatchChunk([7], start_position=5, block_ids=[3, 9]),  # a decode
        BatchChunk([4, 5, 6], start_position=3, block_ids=[2, 5], num_prompt_logits=2),
    ]
    batch = build_forward_batch(chunks, block_size=4)
    assert batch.logits_indices.tolist() == [3, 6, 0, 1, 2, 4, 5]
    assert batch.num_prompt_logits == 5
    plain = build_forward_batch([dataclasses.replace(c, num_prompt_logits=0) for c in chunks], 4)
    assert plain.logits_indices.tolist() == [3, 6] and plain.num_prompt_logits == 0


def test_build_forward_batch_decode_only_and_errors() -> None:
    batch = build_forward_batch([BatchChunk([1], 0, [1]), BatchChunk([2], 9, [1, 2, 3])], 4)
    assert batch.is_decode_only and batch.logits_indices.tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs 3 blocks"):
        build_forward_batch([BatchChunk([1, 2], 8, [1, 2])], 4)
    with pytest.raises(ValueError):
        build_forward_batch([], 4)


def test_kv_caches_layout_and_bytes() -> None:
    caches = allocate_kv_caches(
        ARCH, num_blocks=5, block_size=8, dtype=torch.bfloat16, device="cpu"
    )
    assert len(caches) == 3
    assert all(k.shape == v.shape == (5, 8, 2, 16) for k, v in caches)
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    assert kv_bytes_per_block(ARCH, 8, torch.bfloat16) * 5 == total
    check_kv_caches(ARCH, caches, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        check_kv_caches(ARCH, caches, torch.float32)
    with pytest.raises(ValueError, match="pairs"):
        check_kv_caches(ARCH, caches[:2], torch.bfloat16)


def test_arch_validation() -> None:
    fields = {**ARCH.__dict__, "num_kv_heads": 3}
    with pytest.raises(ModelLoadError, match="multiple"):
        ModelArch(**fields)
    with pytest.raises(ModelLoadError, match="positive"):
        ModelArch(**{**ARCH.__dict__, "num_layers": 0})


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu).name == ("cpu" if native_available() else "torch")
    assert select_attention_backend("torch", cpu).name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        select_attention_backend("triton", cpu)
    with pytest.raises(ConfigError, match="unknown"):
        select_attention_backend("flash", cpu)


def test_triton_backend_runs_model_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever launchers exist, the triton backend computes what the torch backend does."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    ref, tri = select_attention_backend("torch", cpu), select_attention_backend("triton", cpu)
    x, w = torch.randn(5, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(tri.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))


def test_registry() -> None:
    assert get_model_class("qwen3") is get_model_class("llama")
    with pytest.raises(
        ModelLoadError,
        match="supported: deepseek_v3, dots1, gemma3, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe",
    ):
        get_model_class("falcon")


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_decode_batch_equals_the_general_builder(data: st.DataObject) -> None:
    """A plain decode step built without a `BatchChunk` per request: the same tensors."""
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    num = data.draw(st.integers(1, 12))
    positions = data.draw(st.lists(st.integers(0, 80), min_size=num, max_size=num))
    tables = [
        tuple(data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n + 3)))
        for n in (p // block_size + 1 for p in positions)
    ]
    tokens = data.draw(st.lists(st.integers(0, 1000), min_size=num, max_size=num))
    chunks = [BatchChunk([t], p, b) for t, p, b in zip(tokens, positions, tables, strict=True)]
    want = build_forward_batch(chunks, block_size)
    got = build_decode_batch(tokens, positions, tables, block_size)
    for field in dataclasses.fields(ForwardBatch):
        a, b = getattr(want, field.name), getattr(got, field.name)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field
        else:
            assert a == b, field.name
    short = [tables[0][: positions[0] // block_size]]
    with pytest.raises(ValueError):
        build_decode_batch(tokens[:1], positions[:1], short, block_size)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)),
        min_size=1,
        max_size=12,
    )
)
def test_block_tables_are_the_rows_padded_with_the_null_block(
    rows: list[tuple[bool, list[int]]],
) -> None:
    """Rows as `BlockIds` (joined from their own int32 bytes) or as plain tuples: the same
    table, each row padded with the null block (0) to the longest."""
    tables = [BlockIds(ids) if own else tuple(ids) for own, ids in rows]
    batch = build_forward_batch([BatchChunk([1], 0, t) for t in tables], block_size=16)
    width = max(len(ids) for _, ids in rows)
    assert batch.block_tables.tolist() == [ids + [0] * (width - len(ids)) for _, ids in rows]


def test_block_ids_are_a_tuple_with_their_int32_bytes() -> None:
    ids = BlockIds([7, 0, 2**31 - 1])
    assert ids == (7, 0, 2**31 - 1) and ids[1:] == (0, 2**31 - 1) and hash(ids) == hash(tuple(ids))
    assert ids.int32 == struct.pack("=3i", 7, 0, 2**31 - 1)
    grown = ids.extend([5, 9])
    assert type(grown) is BlockIds and grown == (*ids, 5, 9)
    assert grown.int32 == BlockIds(grown).int32 and ids == (7, 0, 2**31 - 1)
    again = pickle.loads(pickle.dumps(ids))
    assert type(again) is BlockIds and again == ids and again.int32 == ids.int32
