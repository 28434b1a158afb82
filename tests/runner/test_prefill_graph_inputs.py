"""Prefill CUDA graphs, what CPU can check: the token buckets, which steps replay at which,
the capture modes off CUDA, and which graphs a runner's step goes to. That the pieces replayed
at a padded bucket give the forward's logits and KV is checked on CPU in
tests/model/test_safetensors.py (the pieces run where the graphs would replay them);
capture and replay themselves need CUDA (tests/gpu/test_cuda_engine.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.model import load_model
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches
from deepinfer.runner.prefill_graphs import (
    PrefillGraphs,
    bucket_for,
    capture_prefill_graphs,
    prefill_buckets,
)
from deepinfer.runner.step_graphs import StepGraphs


def test_prefill_buckets() -> None:
    assert prefill_buckets(2048) == (
        16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048,
    )  # fmt: skip
    assert prefill_buckets(600) == (16, 32, 64, 128, 256, 512, 600)
    assert prefill_buckets(100) == (16, 32, 64, 100)
    assert prefill_buckets(8) == (8,)
    with pytest.raises(ValueError, match="at least 1"):
        prefill_buckets(0)


def test_bucket_for_pads_up_or_runs_eagerly() -> None:
    buckets = prefill_buckets(600)

    def tokens(n: int) -> int | None:
        return bucket_for(build_forward_batch([BatchChunk([1] * n, 0, [1] * 64)], 16), buckets)

    assert [tokens(n) for n in (1, 16, 17, 300, 513, 600)] == [16, 16, 32, 512, 600, 600]
    assert tokens(601) is None


def test_capture_modes_off_cuda(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.float32, "cpu", attention_backend="torch").model
    cpu = torch.device("cpu")
    assert capture_prefill_graphs("auto", model, cpu, 64) is None
    assert capture_prefill_graphs("off", model, cpu, 64) is None
    with pytest.raises(ConfigError, match="need a CUDA device"):
        capture_prefill_graphs("on", model, cpu, 64)
    other: Any = SimpleNamespace(arch=SimpleNamespace(moe=None))  # not a Llama-family decoder
    assert capture_prefill_graphs("auto", other, torch.device("cuda"), 64) is None
    with pytest.raises(ConfigError, match="Llama-family"):
        capture_prefill_graphs("on", other, torch.device("cuda"), 64)


def test_steps_go_to_the_decode_graphs_then_the_prefill_pieces() -> None:
    """A step the decode graphs take is theirs; one they leave (None) goes to the pieces."""
    decode_logits, prefill_logits = torch.zeros(1), torch.ones(1)
    calls: list[str] = []

    def graphs(name: str, result: torch.Tensor | None) -> Any:
        def run(batch: object) -> torch.Tensor | None:
            calls.append(name)
            return result

        return SimpleNamespace(run=run, num_replays=3)

    batch: Any = object()
    both = StepGraphs(graphs("decode", decode_logits), graphs("prefill", prefill_logits))
    assert both.run(batch) is decode_logits and calls == ["decode"]
    left = StepGraphs(graphs("decode", None), graphs("prefill", prefill_logits))
    assert left.run(batch) is prefill_logits and calls[1:] == ["decode", "prefill"]
    assert StepGraphs(prefill=graphs("prefill", None)).run(batch) is None
    assert StepGraphs().run(batch) is None and StepGraphs().num_replays == 0
    assert both.num_replays == 6


class _EagerCapture:
    """`GraphCapture` on CPU: a captured piece replays by running again; the replays are logged."""

    def __init__(self) -> None:
        self.captured = 0
        self.events: list[str] = []

    def capture(self, piece: Any) -> Any:
        self.captured += 1
        return piece

    def synchronize(self) -> None:
        self.events.append("sync")

    def before_replay(self) -> None:
        self.events.append("before")

    def after_replay(self) -> None:
        self.events.append("after")


def test_prefill_graphs_replay_the_eager_logits(tiny_llama_dir: Path) -> None:
    """`PrefillGraphs` with its captures replayed by running the pieces: every bucket's pieces
    captured, a step's logits and KV those of the eager forward at any padding, a step past the
    largest bucket left to the eager path."""
    model = load_model(tiny_llama_dir, torch.float32, "cpu", attention_backend="torch").model
    caches = allocate_kv_caches(model.arch, 32, 16, torch.float32, "cpu")
    model.bind_kv_caches(caches)
    capture = _EagerCapture()
    graphs = PrefillGraphs(model, 100, torch.device("cpu"), capture)
    assert graphs.buckets == (16, 32, 64, 100)
    assert capture.captured == 4 * graphs.pieces.num_pieces
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (90,), generator=g).tolist()
    steps = [  # (chunks): a prompt in two chunks, then it decoding beside a new prompt
        [BatchChunk(prompt[:50], 0, [1, 2, 3, 4], sample=False)],
        [BatchChunk(prompt[50:], 50, [1, 2, 3, 4, 5, 6])],
        [BatchChunk([7], 90, [1, 2, 3, 4, 5, 6]), BatchChunk(prompt[:20], 0, [7, 8])],
    ]
    replayed, eager = [], []
    for run, out in ((graphs.run, replayed), (model, eager)):
        for k, v in caches:
            k.zero_(), v.zero_()
        out.extend(run(build_forward_batch(chunks, 16)) for chunks in steps)
        out.append([(k.clone(), v.clone()) for k, v in caches])
    for got, want in zip(replayed[:-1], eager[:-1], strict=True):
        assert got is not None and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (k, v), (k_eager, v_eager) in zip(replayed[-1], eager[-1], strict=True):
        torch.testing.assert_close(k, k_eager, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v_eager, atol=1e-5, rtol=0)
    assert graphs.num_replays == 3
    assert capture.events[-6:] == ["before", "after"] * 3
    too_long = build_forward_batch([BatchChunk(prompt + prompt[:11], 0, list(range(1, 8)))], 16)
    assert graphs.run(too_long) is None and graphs.num_replays == 3
