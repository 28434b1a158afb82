"""Roofline: this machine's read bandwidth and matmul rate, measured in the same run, against
engine-only decode and prefill rates of deepinfer, transformers and llama.cpp on the same GGUF.

Bounds. Decode: a step of B streams reads every weight once (the bytes each engine serves: the
GGUF's blocks, or fp32 for transformers) plus each stream's KV, so at most
B x bandwidth / (weight bytes + B x context x KV bytes per token) tokens/s. Prefill: 2 x the
layers' matrix parameters FLOPs per token (attention and the one lm_head row not counted) over
the fp32 matmul rate, or over the bf16 rate where deepinfer runs prefill as bf16 tiles
(`--bf16-prefill`, on where a probe finds bf16 matmuls fast: AMX).

deepinfer runs through `EngineCore.step` (no HTTP; one colocated lane, so a 512-token prompt is
one step); transformers is fp32 from the same file (`gguf_file=`: dequantized), driven with its
KV cache; llama.cpp is `llama-server` (`llama-bench` is not built): single-stream decode and
prefill from `/completion`'s `timings`, B streams from the wall time of B concurrent requests at
two lengths (the difference cancels the prompts). Run from the repository root:

    python bench/offline.py
    python bench/offline.py --batch 1 32 64 --context 128 --skip-transformers --skip-llama
    python bench/offline.py --model ~/.cache/deepinfer/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf
    python bench/offline.py --model qwen2.5-coder-1.5b --batch 1 16 64 --skip-transformers --matmul-activations int8
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from common import ROOT, find_llama_server, free_port, llama_cmd, provenance, running

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.core import EngineCore
from deepinfer.environment import default_model_path, resolve_model
from deepinfer.model.loading.gguf_loader import gguf_arch, open_gguf
from deepinfer.request import Request, SamplingParams

PREFILL_TOKENS = 512


@dataclass(frozen=True)
class Machine:
    read_bytes_s: float
    fp32_flop_s: float
    bf16_flop_s: float
    int8_kernel_op_s: float
    """deepinfer's native int8 kernel on cache-resident Q4_1 weights (a kernel rate, not a peak)."""


@dataclass(frozen=True)
class Facts:
    """The model as the GGUF stores it."""

    gguf_bytes: int
    num_params: int
    matmul_params: int
    kv_elems_per_token: int


@dataclass(frozen=True)
class Row:
    engine: str
    phase: str
    tok_s: float
    bound_tok_s: float
    how: str


def best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_machine(buffer_mib: int, matmul_n: int) -> Machine:
    return Machine(
        read_rate(buffer_mib),
        matmul_rate(matmul_n, torch.float32),
        matmul_rate(matmul_n, torch.bfloat16),
        int8_kernel_rate(rows=128),
    )


def read_rate(buffer_mib: int) -> float:
    """Bytes/s of a sum over a float32 buffer far larger than the caches, on every thread."""
    buf = torch.ones(buffer_mib * (1 << 20) // 4)
    return buf.numel() * 4 / best_time(buf.sum, 5)


def matmul_rate(n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: a @ b, 5)


def int8_kernel_rate(rows: int) -> float:
    from quant_gemm import SHAPES, random_q4_1

    from deepinfer.kernels.linear.int8_matmul import int8_linear, pack_int8

    gen = torch.Generator().manual_seed(0)
    packed = [pack_int8(random_q4_1(n, k, gen)) for n, k in SHAPES]
    xs = [torch.randn(rows, k, generator=gen) for _, k in SHAPES]
    ops = sum(2 * rows * n * k for n, k in SHAPES)
    return ops / best_time(lambda: [int8_linear(x, w) for x, w in zip(xs, packed, strict=True)], 10)


def model_facts(path: Path) -> Facts:
    reader = open_gguf(path)
    arch = gguf_arch(reader)
    layer_matrices = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return Facts(
        gguf_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        matmul_params=sum(int(t.n_elements) for t in layer_matrices),
        kv_elems_per_token=2 * arch.num_layers * arch.num_kv_heads * arch.head_dim,
    )


def decode_bound(m: Machine, weight_bytes: float, kv_bytes_token: float, b: int, ctx: int) -> float:
    return b * m.read_bytes_s / (weight_bytes + b * ctx * kv_bytes_token)


def prefill_bound(m: Machine, f: Facts, bf16: bool = False) -> float:
    return (m.bf16_flop_s if bf16 else m.fp32_flop_s) / (2 * f.matmul_params)


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(num)]


# -- deepinfer --


def make_core(path: Path, max_seqs: int, ctx: int, activations: str) -> EngineCore:
    per_seq_blocks = -(-max(ctx + 64, PREFILL_TOKENS + 16) // 16)
    return EngineCore(
        Config(
            model=ModelConfig(path=path, matmul_activations=activations),  # type: ignore[arg-type]
            cache=CacheConfig(
                num_blocks=max_seqs * per_seq_blocks + 64, enable_prefix_caching=False
            ),
            disk_cache=DiskCacheConfig(enabled=False),
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
            workers=WorkersConfig(colocated=True),
        )
    )


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(Request(request_id=rid, prompt_token_ids=prompt, sampling=params))


def deepinfer_prefill(core: EngineCore, reps: int) -> tuple[float, int]:
    """Median tokens/s from adding a 512-token prompt to its first token; steps it took."""
    times, steps = [], 0
    for i, prompt in enumerate(random_prompts(reps + 1, PREFILL_TOKENS, seed=1)):
        add(core, f"prefill-{i}", prompt, 1)
        start, steps = time.perf_counter(), 0
        while not core.step():
            steps += 1
        times.append(time.perf_counter() - start)
    return PREFILL_TOKENS / statistics.median(times[1:]), steps + 1


def deepinfer_decode(core: EngineCore, b: int, ctx: int, steps: int) -> float:
    ids = [f"d{b}-{i}" for i in range(b)]
    for rid, prompt in zip(ids, random_prompts(b, ctx, seed=b), strict=True):
        add(core, rid, prompt, steps + 8)
    started: set[str] = set()
    while len(started) < b:
        started |= {d.request_id for d in core.step()}
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        assert len(core.step()) == b, "every stream decodes each step"
        times.append(time.perf_counter() - start)
    for rid in ids:
        core.abort(rid)
    core.step()
    return b / statistics.median(times[2:])


def deepinfer_rows(ns: argparse.Namespace, m: Machine, f: Facts) -> Iterator[Row]:
    for activations in ns.matmul_activations:
        core = make_core(ns.model, max(ns.batch), ns.context, activations)
        info = core.info
        name = f"deepinfer ({activations} activations)"
        weight_bytes = info.quantized_bytes or f.num_params * 4
        kv_bytes = f.kv_elems_per_token * info.kv_dtype.itemsize
        tok_s, steps = deepinfer_prefill(core, ns.reps)
        tiles = ", bf16 tiles" if info.bf16_prefill else ""
        yield Row(name, f"prefill {PREFILL_TOKENS}", tok_s, prefill_bound(m, f, info.bf16_prefill),
                  f"{steps} step(s){tiles}")  # fmt: skip
        for b in ns.batch:
            bound = decode_bound(m, weight_bytes, kv_bytes, b, ns.context + ns.steps // 2)
            yield Row(name, f"decode B={b}", deepinfer_decode(core, b, ns.context, ns.steps), bound,
                      f"{weight_bytes / 1e6:.1f} MB weights, KV {info.kv_dtype}".replace("torch.", ""))  # fmt: skip
        core.close()


# -- transformers --


def transformers_rows(ns: argparse.Namespace, m: Machine, f: Facts, path: Path) -> Iterator[Row]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    name = "transformers (fp32)"
    yield Row(name, f"prefill {PREFILL_TOKENS}", transformers_prefill(model, ns.reps),
              prefill_bound(m, f), "logits of the last row only")  # fmt: skip
    for b in ns.batch:
        tok_s = transformers_decode(model, b, ns.context, max(4, ns.steps // 2))
        ctx = ns.context + ns.steps // 4
        bound = decode_bound(m, f.num_params * 4, f.kv_elems_per_token * 4, b, ctx)
        yield Row(name, f"decode B={b}", tok_s, bound, "fp32 weights and KV")


@torch.inference_mode()
def transformers_prefill(model: Any, reps: int) -> float:
    prompts = random_prompts(reps + 1, PREFILL_TOKENS, seed=1)
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        model(torch.tensor([prompt]), logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return PREFILL_TOKENS / statistics.median(times[1:])


@torch.inference_mode()
def transformers_decode(model: Any, b: int, ctx: int, steps: int) -> float:
    """Median tokens/s of greedy steps on its KV cache (`cache`, `past_key_values` before 5.x)."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor(random_prompts(b, ctx, seed=b)), use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out = model(nxt, use_cache=True, **{key: getattr(out, key)})
        times.append(time.perf_counter() - start)
    return b / statistics.median(times[1:])


# -- llama.cpp --


async def completions(url: str, prompts: list[list[int]], n_predict: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:

        async def one(prompt: list[int]) -> dict[str, Any]:
            body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                    "ignore_eos": True, "cache_prompt": False}  # fmt: skip
            resp = await client.post(f"{url}/completion", json=body)
            resp.raise_for_status()
            return resp.json()["timings"]

        return await asyncio.gather(*(one(p) for p in prompts))


def wall_s(url: str, prompts: list[list[int]], n_predict: int) -> float:
    start = time.perf_counter()
    asyncio.run(completions(url, prompts, n_predict))
    return time.perf_counter() - start


def llama_rows(ns: argparse.Namespace, m: Machine, f: Facts, path: Path) -> Iterator[Row]:
    binary = find_llama_server()
    if binary is None:
        print("llama-server not found (set LLAMA_SERVER or build it under third_party/): skipped")
        return
    name, kv_bytes = "llama.cpp (llama-server)", f.kv_elems_per_token * 2  # f16 KV
    log = ROOT / "bench" / "out" / "offline_llama.log"
    port = free_port()
    with running(llama_cmd(binary, path, port, 1, 2 * PREFILL_TOKENS), port, log) as url:
        prompts = random_prompts(ns.reps + 1, PREFILL_TOKENS, seed=1)
        timings = [asyncio.run(completions(url, [p], 1))[0] for p in prompts]
        rate = statistics.median(t["prompt_per_second"] for t in timings[1:])
        yield Row(name, f"prefill {PREFILL_TOKENS}", rate, prefill_bound(m, f),
                  "timings.prompt_per_second")  # fmt: skip
    for b in ns.batch:
        prompts = random_prompts(b, ns.context, seed=b)
        port = free_port()
        slot_ctx = ns.context + ns.steps * 2 + 16
        with running(llama_cmd(binary, path, port, b, slot_ctx), port, log) as url:
            bound = decode_bound(m, f.gguf_bytes, kv_bytes, b, ns.context + ns.steps // 2)
            if b == 1:
                (t,) = asyncio.run(completions(url, prompts, ns.steps))
                yield Row(name, "decode B=1", t["predicted_per_second"], bound,
                          "timings.predicted_per_second")  # fmt: skip
                continue
            wall_s(url, prompts[:1], 4)  # warm-up
            short, long = wall_s(url, prompts, 4), wall_s(url, prompts, 4 + ns.steps * 2)
            yield Row(name, f"decode B={b}", b * ns.steps * 2 / (long - short), bound,
                      f"wall({4 + ns.steps * 2}) - wall(4) tokens")  # fmt: skip


# -- report --


def table(rows: list[Row]) -> Iterator[str]:
    yield "| engine | phase | tok/s | bound tok/s | of bound | how |"
    yield "|---|---|---|---|---|---|"
    for r in rows:
        yield (f"| {r.engine} | {r.phase} | {r.tok_s:.1f} | {r.bound_tok_s:.0f} | "
               f"{100 * r.tok_s / r.bound_tok_s:.1f}% | {r.how} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="a GGUF file, or a model `deepinfer pull` knows")  # fmt: skip
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each stream")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--reps", type=int, default=3, help="prefill repetitions")
    ap.add_argument("--matmul-activations", nargs="+", default=["float32", "int8"])
    ap.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth buffer")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ns = ap.parse_args()
    path = resolve_model(ns.model.expanduser())
    if not path.is_file():
        raise SystemExit(f"no model file for {str(ns.model)!r}: run `deepinfer pull {ns.model}`")
    ns.model = path
    facts = model_facts(path)
    load_start = os.getloadavg()[0]
    machine = measure_machine(ns.buffer_mib, matmul_n=2048)
    print(f"machine: read {machine.read_bytes_s / 1e9:.1f} GB/s (sum over {ns.buffer_mib} MiB), "
          f"fp32 matmul {machine.fp32_flop_s / 1e9:.1f} GFLOP/s, bf16 "
          f"{machine.bf16_flop_s / 1e9:.1f} (2048^3), int8 kernel "
          f"{machine.int8_kernel_op_s / 1e9:.1f} GOP/s; {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    rows: list[Row] = []
    sources: list[Iterator[Row]] = [deepinfer_rows(ns, machine, facts)]
    sources += [] if ns.skip_transformers else [transformers_rows(ns, machine, facts, path)]
    sources += [] if ns.skip_llama else [llama_rows(ns, machine, facts, path)]
    for source in sources:
        for row in source:
            rows.append(row)
            print(list(table([row]))[-1], flush=True)
    print(f"\n### Roofline: `bench/offline.py`\n\n{provenance()}\n")
    print(f"{path.name}: {facts.gguf_bytes / 1e6:.1f} MB of tensors, {facts.num_params / 1e6:.1f}M "
          f"parameters ({facts.matmul_params / 1e6:.1f}M in the layers' matrices); decode streams "
          f"of {ns.context} prompt tokens. Machine: read {machine.read_bytes_s / 1e9:.1f} GB/s, "
          f"fp32 matmul {machine.fp32_flop_s / 1e9:.1f} GFLOP/s, bf16 "
          f"{machine.bf16_flop_s / 1e9:.1f}, deepinfer's int8 kernel "
          f"{machine.int8_kernel_op_s / 1e9:.1f} GOP/s (M=128, cache-resident). Load average "
          f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n")  # fmt: skip
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
