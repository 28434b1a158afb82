"""What decode CUDA graphs replay, checked on CPU: the padded static batch gives each real row
the logits of the eager batch and writes no KV for padding rows; the sizes and the eager cases.
Capture and replay themselves need CUDA (tests/gpu/test_cuda_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.model import load_model
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches
from deepinfer.runner.cuda_graphs import (
    StaticDecodeInputs,
    capture_decode_graphs,
    graph_batch_sizes,
    replay_size,
)

BLOCK = 16


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(6) == (1, 2, 4, 6)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    with pytest.raises(ValueError, match="at least 1"):
        graph_batch_sizes(0)


def _decode_batch(n: int, width: int = 3):  # type: ignore[no-untyped-def]
    chunks = [
        BatchChunk([100 + i], 20 + i, [1 + width * i + j for j in range(width)]) for i in range(n)
    ]
    return build_forward_batch(chunks, BLOCK)


def test_replay_size_picks_the_next_size_or_eager() -> None:
    sizes = (1, 2, 4, 8)
    assert [replay_size(_decode_batch(n), sizes, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert replay_size(_decode_batch(9), sizes, 8) is None  # more requests than captured
    assert replay_size(_decode_batch(2, width=9), sizes, 8) is None  # too long a context
    prefill = build_forward_batch([BatchChunk([1, 2, 3], 0, [1])], BLOCK)
    assert replay_size(prefill, sizes, 8) is None
    silent = build_forward_batch([BatchChunk([1], 5, [1], sample=False)], BLOCK)
    assert silent.is_decode_only and replay_size(silent, sizes, 8) is None


def test_padded_static_batch_matches_the_eager_one(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir, torch.float32, "cpu", attention_backend="torch")
    model = loaded.model
    caches = allocate_kv_caches(loaded.arch, 32, BLOCK, torch.float32, "cpu")
    for k, v in caches:  # poison the null block: padding rows read it, and must not write it
        k[0].fill_(7.0), v[0].fill_(-7.0)
    model.bind_kv_caches(caches)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (20, 33, 7)]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    model(
        build_forward_batch(
            [BatchChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BLOCK
        )
    )
    decode = build_forward_batch(
        [
            BatchChunk([5 + i], len(p), t)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ],
        BLOCK,
    )
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    eager = model(decode)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, snapshot, strict=True):  # undo the decode step's KV writes
        k.copy_(k0), v.copy_(v0)

    inputs = StaticDecodeInputs(8, 12, torch.device("cpu"))
    inputs.load(_decode_batch(8, width=12), 8)  # a wider, fuller batch first: must not linger
    inputs.load(decode, 8)
    padded = model(inputs.batch(8))
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    for (k, v), (ek, ev) in zip(
        caches, eager_caches, strict=True
    ):  # the same KV, null block untouched
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)
        assert k[0].eq(7.0).all() and v[0].eq(-7.0).all()
    assert inputs.slot_mapping[3:].eq(-1).all() and inputs.context_lens[3:].eq(1).all()
    assert inputs.block_tables[:3, 3:].eq(0).all() and inputs.block_tables[3:].eq(0).all()


def test_capture_modes_off_cuda(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.float32, "cpu", attention_backend="torch").model
    cpu = torch.device("cpu")
    assert capture_decode_graphs("auto", model, cpu, 8, 4) is None
    assert capture_decode_graphs("off", model, cpu, 8, 4) is None
    with pytest.raises(ConfigError, match="need a CUDA device"):
        capture_decode_graphs("on", model, cpu, 8, 4)


def test_a_verifying_step_replays_the_decode_graphs() -> None:
    """Two decodes, one verifying three drafts: six decode rows, replayed at size 8."""
    from deepinfer.request import Request, SamplingParams
    from deepinfer.runner.batch_builder import schedule_to_batch
    from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput, StepKind

    requests = [Request(f"r{i}", list(range(100, 130)), SamplingParams()) for i in range(2)]
    chunks = (
        ScheduledChunk(requests[0], 29, 4, (1, 2, 3), True, (7, 8, 9)),
        ScheduledChunk(requests[1], 29, 1, (4, 5, 6), True),
    )
    so = ScheduleOutput(1, chunks, kind=StepKind.DECODE)
    batch, rows = schedule_to_batch(so, BLOCK, torch.device("cpu"))
    assert rows == ["r0"] * 4 + ["r1"]
    assert batch.is_decode_only and batch.context_lens.tolist() == [30, 31, 32, 33, 30]
    assert batch.input_ids.tolist() == [129, 7, 8, 9, 129]
    assert replay_size(batch, (1, 2, 4, 8), 8) == 8
