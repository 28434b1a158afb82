"""Tensor parallel over gloo ranks (processes the engine starts): a tiny random Llama and a
tiny random Qwen3 (per-head q/k norms) with 4 KV heads, split over 1, 2 and 4 ranks, and
SmolLM2's GGUF file (9 heads, 3 KV heads: 2 ranks hold 2 and 1 KV heads, the fourth of 4 ranks
none, only its share of the FFN) served in its Q4_1 blocks over 1, 2 and 4 ranks. Greedy tokens
are identical and every prompt and sampled log-probability (top 5) within 1e-4 of one rank's,
with float32 activations and KV. With the default int8 activations (and float16 KV), and in
`--batch-invariant` mode, each rank's int8 products go on from the previous rank's sums and every
bit is one rank's, on Gemma 3's sliding windows too. A Qwen2-MoE's experts go over the same
ranks; a draft model and prompt lookup speculate over the ranks. A prompt run again is a
prefix-cache hit on every rank; a rank killed stops the engine with the reason instead of
answering from part of the model."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ExpertsConfig,
    KVTransferConfig,
    ModelConfig,
    TensorParallelConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.build import build_engine
from deepinfer.environment import default_model_dir
from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.request import SamplingParams
from tests.server_proc import free_port

pytestmark = pytest.mark.slow
REAL = {
    "gemma3-270m": default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": default_model_dir()
    / "qwen2.5-coder-1.5b"
    / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 128, 8, 4, 16, 1024, 2, 49152
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5,
                        prompt_logprobs=5)  # fmt: skip
PROMPTS = [[(i * 97 + j * 13) % 3000 + 50 for j in range(n)] for i, n in enumerate((7, 40, 90))]


def write_model(path: Path, qk_norm: bool) -> Path:
    from safetensors.torch import save_file

    from deepinfer.environment import default_model_path
    from deepinfer.model.loading.gguf_loader import open_gguf
    from deepinfer.text.tokenizer import Tokenizer

    g = torch.Generator().manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
        if qk_norm:
            tensors |= {p + "self_attn.q_norm.weight": 1 + w(HEAD_DIM),
                        p + "self_attn.k_norm.weight": 1 + w(HEAD_DIM)}  # fmt: skip
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "model_type": "qwen3" if qk_norm else "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path


def at_defaults(path: Path, ranks: int, batch_invariant: bool = False, blocks: int = 64) -> Config:
    """`path` over `ranks` at the default numerics (int8 activations where the kernel serves
    it, float16 KV)."""
    return Config(
        model=ModelConfig(path=path, batch_invariant=batch_invariant),
        cache=CacheConfig(num_blocks=blocks),
        disk_cache=DiskCacheConfig(enabled=False),
        experts=ExpertsConfig(master_port=free_port()),
        tensor_parallel=TensorParallelConfig(tensor_parallel=ranks),
    )


def config(model: Path, ranks: int) -> Config:
    return Config(
        model=ModelConfig(path=model, dtype="float32", matmul_activations="float32"),
        cache=CacheConfig(num_blocks=64, kv_dtype="float32"),
        disk_cache=DiskCacheConfig(enabled=False),
        experts=ExpertsConfig(master_port=free_port()),
        tensor_parallel=TensorParallelConfig(tensor_parallel=ranks),
    )


async def run(engine: AsyncEngine) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Each prompt's tokens and every top-5 list (the prompt's, then the sampled tokens')."""
    out = []
    for ids in PROMPTS:
        tokens: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        async for delta in engine.generate(ids, PARAMS):
            tokens += delta.token_ids
            tops += [list(p.top_logprobs) for p in delta.prompt_logprobs or ()]
            tops += [list(s.top_logprobs) for s in delta.logprobs]
        out.append((tokens, tops))
    return out


def close(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> float:
    """The largest log-probability difference (same tokens in each top list, or inf)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if [t for t, _ in x] != [t for t, _ in y]:
            return float("inf")
        worst = max(worst, *(abs(p - q) for (_, p), (_, q) in zip(x, y, strict=True)))
    return worst


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
async def test_ranks_agree_with_one(tmp_path: Path, qk_norm: bool) -> None:
    model = write_model(tmp_path / "model", qk_norm)
    results = {}
    for ranks in (1, 2, 4):
        async with AsyncEngine(config(model, ranks)) as engine:
            arch = engine.core.runner.model.arch  # rank 0's shard
            assert (arch.num_kv_heads, arch.num_heads) == (KV_HEADS // ranks, HEADS // ranks)
            assert arch.intermediate_size == FFN // ranks
            results[ranks] = await run(engine)
    for ranks in (2, 4):
        for (tokens, tops), (want_tokens, want_tops) in zip(
            results[ranks], results[1], strict=True
        ):
            assert tokens == want_tokens
            assert close(tops, want_tops) <= 1e-4, (ranks, close(tops, want_tops))


async def test_smollm2_blocks_split_over_two_and_four_ranks() -> None:
    from deepinfer.environment import default_model_path

    results = {}
    for ranks in (1, 2, 4):
        async with AsyncEngine(config(default_model_path(), ranks)) as engine:
            assert engine.info.quantized_bytes > 0  # served from its blocks
            results[ranks] = await run(engine)
            if ranks == 2:  # again: the prompt's full blocks are hits on both ranks
                again = await run(engine)
                assert again == results[2]
                greedy = SamplingParams(max_tokens=4, temperature=0.0)  # no prompt logprobs
                turns = [
                    [
                        (d.token_ids, d.usage.cached_tokens)
                        async for d in engine.generate(ids, greedy)
                    ]
                    for ids in (PROMPTS[2], PROMPTS[2])
                ]
                assert [sum((t for t, _ in turn), ()) for turn in turns] == [
                    sum((t for t, _ in turns[0]), ())
                ] * 2
                assert turns[1][-1][1] == (len(PROMPTS[2]) - 1) // 16 * 16
            if ranks == 4:  # the last rank holds no heads
                arch = engine.core.runner.model.arch
                assert (arch.num_kv_heads, arch.num_heads) == (1, 3)
    for ranks in (2, 4):
        for (tokens, tops), (want_tokens, want_tops) in zip(
            results[ranks], results[1], strict=True
        ):
            assert tokens == want_tokens
            assert close(tops, want_tops) <= 1e-4, (ranks, close(tops, want_tops))
        # float32 activations: the ranks' products are added, not continued (not one rank's
        # bits, so the equality below, at int8 activations, is a check that can fail)
        assert results[ranks] != results[1]


async def test_int8_ranks_give_one_ranks_bits() -> None:
    """The default flags (int8 activations, float16 KV) over 2 and 4 ranks, and
    --batch-invariant over 2: the very log-probabilities of one rank (and so its tokens), as
    each rank's int8 products go on from the previous rank's sums."""
    from deepinfer.environment import default_model_path

    results = {}
    for ranks, invariant in ((1, False), (2, False), (4, False), (1, True), (2, True)):
        async with AsyncEngine(at_defaults(default_model_path(), ranks, invariant)) as engine:
            results[ranks, invariant] = await run(engine)
    assert results[2, False] == results[1, False]
    assert results[4, False] == results[1, False]
    assert results[2, True] == results[1, True]


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-1.5b"])
async def test_real_files_over_two_ranks(name: str) -> None:
    """Gemma 3 270M (Q4_K_M: Q4_K, Q6_K and Q5_0 matrices; 15 of 18 layers attending a window;
    one KV head, so the second rank holds no heads, only its half of the FFN) and, where it is
    pulled, Qwen2.5-Coder 1.5B (Q4_K_M, q/k/v biases, 2 KV heads): the default flags give one
    rank's log-probabilities to the bit."""
    path = REAL[name]
    if not path.is_file():
        pytest.skip(f"run `deepinfer pull {name}`")
    results = {}
    for ranks in (1, 2):
        async with AsyncEngine(at_defaults(path, ranks)) as engine:
            results[ranks] = await run(engine)
    assert results[2] == results[1]


@pytest.mark.parametrize("method", ["draft-model", "ngram"])
async def test_speculation_over_ranks(method: str) -> None:
    """Speculative decoding over 2 ranks: the draft model runs whole on rank 0 (a model of its
    own, outside the ranks' lockstep), the verification steps over the ranks; drafts are
    accepted and the answers are one rank's with the same flags, token for token."""
    from deepinfer.config import SpeculativeConfig
    from deepinfer.environment import default_model_path

    path = default_model_path()
    repeat = [(j * 17) % 300 + 200 for j in range(24)]
    prompts = [repeat * 3, PROMPTS[1] + PROMPTS[1]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for ranks in (1, 2):
        serving = at_defaults(path, ranks, blocks=128).replace(
            speculative=SpeculativeConfig(
                speculative=method,  # type: ignore[arg-type]
                draft_model=str(path) if method == "draft-model" else None,
                speculative_gate="off",
            ),
        )
        async with AsyncEngine(serving) as engine:
            results[ranks] = [
                [t async for d in engine.generate(ids, greedy) for t in d.token_ids]
                for ids in prompts
            ]
            counts = engine.stats().speculative
            assert counts.num_accepted > 0, counts
    assert results[2] == results[1]


async def test_experts_over_the_same_ranks(tmp_path: Path) -> None:
    """A Qwen2-MoE (experts beside a gated shared expert, and a dense layer) with
    `--tensor-parallel N --expert-parallel N`: each rank holds its heads, its share of the dense
    and shared FFNs' features and N-th of the experts; greedy tokens equal one rank's and every
    log-probability is within 1e-4, over 2 and 4 ranks."""
    pytest.importorskip("transformers")
    from tests.engine.tiny_moe import qwen2_moe_config, save_random

    model, _ = save_random(qwen2_moe_config(), (".mlp.",), tmp_path / "moe")
    results = {}
    for ranks in (1, 2, 4):
        serving = config(model, ranks)
        if ranks > 1:
            serving = serving.replace(
                experts=ExpertsConfig(expert_parallel=ranks, master_port=free_port())
            )
        async with AsyncEngine(serving) as engine:
            assert engine.core.experts is None  # no expert groups: the ranks are the split
            block = engine.core.runner.model.layers[0].mlp
            assert block.experts_here == (None if ranks == 1 else (0, 8 // ranks))
            results[ranks] = await run(engine)
    for ranks in (2, 4):
        for (tokens, tops), (want_tokens, want_tops) in zip(
            results[ranks], results[1], strict=True
        ):
            assert tokens == want_tokens
            assert close(tops, want_tops) <= 1e-4, (ranks, close(tops, want_tops))
    with pytest.raises(ConfigError, match="add --expert-parallel 2"):
        build_engine(config(model, 2))


async def test_a_rank_killed_stops_the_engine_with_the_reason(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model", False)
    async with AsyncEngine(config(model, 2)) as engine:
        assert (await run(engine))[0][0]
        ranks = engine.core._tensor_parallel
        assert ranks is not None
        process = ranks.processes[0]
        assert process.pid is not None
        os.kill(process.pid, 9)
        process.join(10)
        with pytest.raises(DeepInferError):
            await run(engine)
        assert engine.dead_reason is not None and "tensor-parallel" in engine.dead_reason


async def test_a_second_machine_joins_with_the_serve_command(tmp_path: Path) -> None:
    """Two "machines" of one rank each: node 1 runs `deepinfer serve --node-rank 1` (as on
    another host: it starts its rank and waits), node 0 serves; its answers are one rank's, and
    node 1's command ends when node 0 shuts down."""
    model = write_model(tmp_path / "model", False)
    async with AsyncEngine(config(model, 1)) as engine:
        alone = await run(engine)
    two = config(model, 2)
    port = two.experts.master_port
    node1 = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(model),
        "--tensor-parallel", "2", "--nnodes", "2", "--node-rank", "1", "--master-port",
        str(port), "--no-disk-cache", "--matmul-activations", "float32", "--kv-dtype", "float32",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        nodes = two.replace(experts=ExpertsConfig(nnodes=2, master_port=port))
        async with AsyncEngine(nodes) as engine:
            ranks = engine.core._tensor_parallel
            assert ranks is not None and not ranks.processes  # its rank is node 1's
            got = await run(engine)
        out, _ = await asyncio.wait_for(node1.communicate(), timeout=60)
    finally:
        if node1.returncode is None:
            node1.kill()
            await node1.wait()
    assert [t for t, _ in got] == [t for t, _ in alone]
    assert max(close(a, b) for (_, a), (_, b) in zip(got, alone, strict=True)) <= 1e-4
    assert node1.returncode == 0, out.decode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensor_parallel": TensorParallelConfig(tensor_parallel=16)}, "at most that many"),
        (
            {"model": ModelConfig(batch_invariant=True, matmul_activations="float32")},
            "int8 CPU kernel alone",
        ),
        ({"experts": ExpertsConfig(expert_parallel=4)}, "the experts go over the same ranks"),
        ({"kv_transfer": KVTransferConfig(kv_transfer="nixl")}, "one or the other"),
    ],
)
def test_what_cannot_be_split_is_refused(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    model = write_model(tmp_path / "model", False)
    with pytest.raises(ConfigError, match=message):
        build_engine(config(model, 2).replace(**change))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("deepinfer-tp")]
