"""Expert parallelism through the whole engine: a random Mixture-of-Experts model of modest
shape (Qwen3-MoE layout: 4 layers, hidden 512, 64 experts of width 256, top 8, written by
transformers) served with every expert in one place, over 4 CPU thread groups of this process
with EPLB (8 redundant replicas, re-placed every 16 steps), and over 2 torch.distributed
processes (gloo) with EPLB, in one run. Reported: generated tokens/s (32 concurrent requests,
greedy), the groups' share of rows, placements swapped, and whether the tokens are the same as
unparallel (they must be).

On these 2 cores the groups cannot run faster than one (the cores are shared); the figures are
the cost of splitting, dispatching and combining, and for processes of the exchange. Run from
the repository root:

    python bench/expert_parallel.py
    python bench/expert_parallel.py --requests 64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import time
from pathlib import Path

import torch
from common import provenance

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ExpertsConfig,
    ModelConfig,
    SchedulerConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import SamplingParams
from deepinfer.text.tokenizer import Tokenizer


def write_model(path: Path) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a skewed router: some experts far more popular than others
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.05 * torch.randn_like(param))
                param[:8] *= 6.0
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(path: Path, experts: ExpertsConfig, ns: argparse.Namespace) -> tuple:
    config = Config(
        model=ModelConfig(path=path, dtype="float32"),
        cache=CacheConfig(num_blocks=2048),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=64),
        experts=experts,
    )
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [
        [(i * 131 + j * 17) % 40000 + 100 for j in range(24 + i % 16)] for i in range(ns.requests)
    ]
    async with AsyncEngine(config) as engine:

        async def one(ids: list[int]) -> list[int]:
            out: list[int] = []
            async for delta in engine.generate(ids, params):
                out.extend(delta.token_ids)
            return out

        await one(prompts[0])  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        ep = engine.stats().expert_parallel
    return tokens, seconds, ep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ns = ap.parse_args()
    modes = {
        "every expert here": ExpertsConfig(),
        "4 thread groups, EPLB": ExpertsConfig(
            expert_parallel=4, redundant_experts=8, eplb_interval=16
        ),
        "2 gloo processes, EPLB": ExpertsConfig(
            expert_parallel=2,
            expert_parallel_backend="gloo",
            redundant_experts=8,
            eplb_interval=16,
            master_port=free_port(),
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_model(path)
        results = {name: asyncio.run(serve(path, e, ns)) for name, e in modes.items()}
    print(
        f"\n### Expert parallelism through the engine: `bench/expert_parallel.py`\n\n{provenance()}\n"
    )
    print(
        f"random Qwen3-MoE layout, 4 layers, hidden 512, 64 experts of width 256, top 8; "
        f"{ns.requests} concurrent greedy requests of {ns.max_tokens} tokens, float32\n"
    )
    print("| mode | tokens/s | vs one place | rows per group | swaps | same tokens |")
    print("|---|---|---|---|---|---|")
    base_tokens, base_s, _ = results["every expert here"]
    n = sum(len(t) for t in base_tokens)
    for name, (tokens, seconds, ep) in results.items():
        rows = "-" if ep is None else " / ".join(f"{r:,}" for r in ep.group_rows)
        swaps = "-" if ep is None else str(ep.swaps)
        print(
            f"| {name} | {n / seconds:,.0f} | {base_s / seconds:.2f}x | {rows} | {swaps} | "
            f"{'yes' if tokens == base_tokens else 'NO'} |"
        )


if __name__ == "__main__":
    main()
