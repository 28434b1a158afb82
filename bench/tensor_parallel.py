"""Tensor parallel through the whole engine: SmolLM2's GGUF file (Q4_1 blocks, 3 KV heads)
served by 1, 2 and 4 gloo ranks in one run (over 4 the last holds no heads), the machine's cores
shared among the ranks. Reported per rank count: start-up (engine built, ranks joined),
generated tokens/s with 1 and 8 concurrent greedy requests, and how far its answers are from one
rank's: at the default flags, whether 4 requests run one at a time have one rank's top-5
log-probabilities to the bit, and how many of the 8 concurrent greedy answers equal one rank's
(outside `--batch-invariant` mode a step's batch changes an answer's arithmetic, and the batches
differ with the engines' speeds); with float32 activations and KV the largest difference of a
top-5 log-probability; in `--batch-invariant` mode whether 4 concurrent requests have one rank's
bits, and that mode's tokens/s at 8 streams.

On these 2 cores the ranks cannot run faster than one (they share the cores): the figures are
the cost of splitting, broadcasting each step's batch and the sums over gloo. Run from
the repository root:

    python bench/tensor_parallel.py
    python bench/tensor_parallel.py --ranks 1,2 --max-tokens 64

It also times gloo itself between two processes of this machine: an all-reduce of a decode
step's [8, 576] activations, the same sum as the engine makes it over gloo (sent to the next
rank, added, broadcast from the last), and the broadcast of a small object (each forward makes
two sums a layer and one broadcast).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

from common import provenance

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ExpertsConfig,
    ModelConfig,
    TensorParallelConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.environment import default_model_path
from deepinfer.request import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_times(rank: int, port: int, out: dict[str, float]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(8, 576)
    for _ in range(50):
        dist.all_reduce(t)
    start = time.perf_counter()
    for _ in range(500):
        dist.all_reduce(t)
    reduce_s = (time.perf_counter() - start) / 500
    start = time.perf_counter()
    for _ in range(500):  # the engine's sum over gloo: rank 0 sends, rank 1 adds, broadcasts
        if rank == 0:
            dist.send(t, 1)
        else:
            before = torch.empty_like(t)
            dist.recv(before, 0)
            t = before + t
        dist.broadcast(t, 1)
    chain_s = (time.perf_counter() - start) / 500
    start = time.perf_counter()
    for _ in range(200):
        box: list[object] = [("step", torch.arange(64), None)] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
    if rank == 0:
        out["all_reduce_ms"] = reduce_s * 1e3
        out["chain_ms"] = chain_s * 1e3
        out["broadcast_ms"] = (time.perf_counter() - start) / 200 * 1e3
    dist.destroy_process_group()


def gloo_times() -> dict[str, float]:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_times, args=(free_port(), out), nprocs=2)
        return dict(out)


def prompts(n: int) -> list[list[int]]:
    return [[(i * 131 + j * 17) % 4000 + 200 for j in range(40 + 7 * i)] for i in range(n)]


def config(ranks: int, exact: bool, invariant: bool = False) -> Config:
    model = ModelConfig(path=default_model_path(), batch_invariant=invariant)
    cache = CacheConfig(num_blocks=512)
    if exact:
        model = ModelConfig(path=default_model_path(), matmul_activations="float32")
        cache = CacheConfig(num_blocks=512, kv_dtype="float32")
    return Config(
        model=model,
        cache=cache,
        disk_cache=DiskCacheConfig(enabled=False),
        experts=ExpertsConfig(master_port=free_port()),
        tensor_parallel=TensorParallelConfig(tensor_parallel=ranks),
    )


async def answers(
    engine: AsyncEngine, batch: list[list[int]], params: SamplingParams
) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    async def one(ids: list[int]) -> tuple[list[int], list[list[tuple[int, float]]]]:
        tokens: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        async for d in engine.generate(ids, params):
            tokens += d.token_ids
            tops += [list(s.top_logprobs) for s in d.logprobs]
        return tokens, tops

    return list(await asyncio.gather(*(one(ids) for ids in batch)))


async def measure(ranks: int, args: argparse.Namespace) -> dict[str, object]:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    exact = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    row: dict[str, object] = {"ranks": ranks}
    start = time.perf_counter()
    async with AsyncEngine(config(ranks, exact=False)) as engine:
        row["start_s"] = time.perf_counter() - start
        await answers(engine, prompts(1), SamplingParams(max_tokens=4))  # warm-up
        # first, while the prefix cache holds no KV of a batch (whose arithmetic differs)
        row["default"] = [(await answers(engine, [p], exact))[0] for p in prompts(4)]
        for streams in (1, 8):
            t = time.perf_counter()
            out = await answers(engine, prompts(streams), greedy)
            row[f"tok_s_{streams}"] = sum(len(o[0]) for o in out) / (time.perf_counter() - t)
            row[f"tokens_{streams}"] = [o[0] for o in out]
    async with AsyncEngine(config(ranks, exact=True)) as engine:
        row["exact"] = await answers(engine, prompts(4), exact)
    async with AsyncEngine(config(ranks, exact=False, invariant=True)) as engine:
        row["invariant"] = await answers(engine, prompts(4), exact)
        t = time.perf_counter()
        out = await answers(engine, prompts(8), greedy)
        row["invariant_tok_s_8"] = sum(len(o[0]) for o in out) / (time.perf_counter() - t)
    return row


def worst(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> float:
    diff = 0.0
    for x, y in zip(a, b, strict=True):
        if [t for t, _ in x] != [t for t, _ in y]:
            return float("inf")
        diff = max(diff, *(abs(p - q) for (_, p), (_, q) in zip(x, y, strict=True)))
    return diff


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = [await measure(int(r), args) for r in args.ranks.split(",")]
    one = rows[0]
    times = gloo_times()
    print(f"\n{provenance()}\n")
    print(f"gloo between two processes: all-reduce of [8, 576] float32 "
          f"{times['all_reduce_ms']:.2f} ms, the same sum sent, added and broadcast "
          f"{times['chain_ms']:.2f} ms, broadcast of a small object "
          f"{times['broadcast_ms']:.2f} ms\n")  # fmt: skip
    print("| ranks | start-up s | tok/s 1 stream | tok/s 8 streams | default flags, one request "
          "at a time: bits as 1 rank | greedy tokens as 1 rank, 8 concurrent (default flags) | "
          "top-5 logprob max diff (float32 activations and KV) | --batch-invariant, 4 "
          "concurrent: bits as 1 rank | --batch-invariant tok/s 8 streams |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = sum(a == b for a, b in zip(r["tokens_8"], one["tokens_8"], strict=True))  # type: ignore[call-overload]
        default = "identical" if r["default"] == one["default"] else "differ"
        diffs = [worst(a[1], b[1]) for a, b in zip(r["exact"], one["exact"], strict=True)]  # type: ignore[call-overload]
        bits = "identical" if r["invariant"] == one["invariant"] else "differ"
        print(f"| {r['ranks']} | {r['start_s']:.1f} | {r['tok_s_1']:.1f} | {r['tok_s_8']:.1f} | "
              f"{default} | {same}/8 | {max(diffs):.1e} | {bits} | "
              f"{r['invariant_tok_s_8']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
