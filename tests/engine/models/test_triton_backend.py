"""The engine with `--attention-backend triton` (Triton interpreter on CPU) gives the same greedy
tokens as the torch backend, on a tiny random Llama with the real tokenizer; with
`--batch-invariant`, the same bits whatever the batch and the chunking."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from deepinfer.engine.core import EngineCore
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import Request, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepinfer.environment import default_model_path
    from deepinfer.text.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path


def _greedy(model_dir: Path, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    config = Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=16, kv_dtype="float32"),  # Triton's, for both
        disk_cache=DiskCacheConfig(enabled=False),
        runtime=RuntimeConfig(device="cpu", attention_backend=backend),  # type: ignore[arg-type]
    )
    core = EngineCore(config)
    assert core.info.attention_backend == backend
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"r{i}", list(ids), params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for delta in core.step():
            outputs[delta.request_id].extend(delta.token_ids)
        core.check_integrity()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_triton_backend_matches_torch(tiny_llama_dir: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 40)]
    prompts.append([*prompts[2][:33], 7, 8, 9])  # shares a two-block prefix with the third
    torch_tokens = _greedy(tiny_llama_dir, "torch", prompts)
    triton_tokens = _greedy(tiny_llama_dir, "triton", prompts)
    assert all(len(t) == 12 for t in torch_tokens)
    assert triton_tokens == torch_tokens


def _invariant_run(
    model_dir: Path, batch: list[list[int]], target: list[int], chunk_tokens: int, seed: int
) -> tuple[tuple[int, bytes], ...]:
    """The target's (token id, logprob and top-2 bits) per token, run beside `batch` on a
    batch-invariant engine whose steps take at most `chunk_tokens` prompt tokens (and checked
    equal to the same request's run again, with its prefix cached, once the others are done)."""
    config = Config(
        model=ModelConfig(path=model_dir, dtype="float32", batch_invariant=True),
        cache=CacheConfig(num_blocks=64, block_size=16, kv_dtype="float32"),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk_tokens, max_num_seqs=8),
        runtime=RuntimeConfig(device="cpu", attention_backend="triton"),
    )
    core = EngineCore(config)
    assert core.info.attention_backend == "triton" and core.info.batch_invariant
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=seed, logprobs=2)
    for i, ids in enumerate(batch):
        core.add_request(Request(f"other{i}", ids, SamplingParams(max_tokens=4, temperature=0.0)))
    core.add_request(Request("target", target, params))
    runs: list[list[tuple[int, bytes]]] = []
    for again in (False, True):  # the second time, its full blocks come from the prefix cache
        if again:
            core.add_request(Request("target", target, params))
        runs.append([])
        while core.has_work:
            for delta in core.step():
                if delta.request_id == "target":
                    for t in delta.logprobs:
                        tops = [v for _, v in t.top_logprobs]
                        runs[-1].append((t.token_id, struct.pack("<3d", t.logprob, *tops)))
    assert runs[1] == runs[0], "a prefix from the cache changed the bits"
    return tuple(runs[0])


def test_batch_invariant_triton_path(tiny_llama_dir: Path) -> None:
    """`--batch-invariant` on the triton backend (the interpreter here; CUDA in tests/gpu):
    every matrix through the fixed-order matmul, every query through the decode kernel, so a
    request's tokens and logprob bits do not change with the batch or the prompt's chunking."""
    target = [(i * 29) % 4000 + 100 for i in range(45)]
    others = [[(i * 13 + j) % 4000 + 100 for i in range(n)] for j, n in enumerate((30, 7, 52))]
    alone = _invariant_run(tiny_llama_dir, [], target, 512, seed=3)
    assert len(alone) == 4
    assert _invariant_run(tiny_llama_dir, others, target, 512, seed=3) == alone
    assert _invariant_run(tiny_llama_dir, others, target, 17, seed=3) == alone  # chunked
