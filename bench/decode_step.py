"""Engine-only decode step timing on the real model, with a torch.profiler breakdown.

Loads SmolLM2 through `EngineCore`, prefills B requests of 300-600 random prompt tokens, then
times `core.step()` over N pure-decode steps (greedy, ignore_eos) for each batch size, and
prints the top ops by self CPU time plus the phases of a step (recorded as profiler ranges).

    python3 -m bench.decode_step --batch 1 8 32 --steps 20 --profile-steps 5
    python3 -m bench.decode_step --device cuda --dtype bfloat16 --batch 1 8 32 64
    python3 -m bench.decode_step --batch 32 --time-calls --kv-dtype float16 --prompt-tokens 40 90
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.core import EngineCore
from deepinfer.request import Request, SamplingParams


def _ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"phase:{name}"):
            return fn(*args, **kwargs)

    return wrapper


def instrument(core: EngineCore) -> None:
    """Wrap the phases of a step in profiler ranges (instance attributes: no source edits)."""
    import deepinfer.runner.model_runner as mr

    runner = core.runner
    targets: list[tuple[object, str, str]] = [
        (core, "schedule", "schedule"),
        (core, "execute", "execute"),
        (core, "update", "update"),
        (mr, "schedule_to_batch", "batch"),
        (runner.model, "forward_hidden", "forward"),
        (runner.model, "compute_logits", "logits"),
        (runner.sampler, "sample", "sample"),
    ]
    targets += [(lane, "schedule", "schedule") for lane in getattr(core, "lanes", ())]
    for owner, attr, name in targets:
        if hasattr(owner, attr):  # the engine's API moves; time what exists
            with contextlib.suppress(AttributeError, TypeError):
                setattr(owner, attr, _ranged(name, getattr(owner, attr)))


def make_core(
    max_seqs: int,
    threads: int | None,
    quantized_matmul: str = "auto",
    device: str = "cpu",
    dtype: str = "float32",
    cuda_graphs: str = "auto",
    kv_dtype: str = "auto",
    matmul_activations: str = "float32",
    model: str | None = None,
) -> EngineCore:
    from deepinfer.config import RuntimeConfig

    config = Config(
        model=ModelConfig(
            path=Path(model) if model else None,
            dtype=dtype,  # type: ignore[arg-type]
            quantized_matmul=quantized_matmul,  # type: ignore[arg-type]
            matmul_activations=matmul_activations,  # type: ignore[arg-type]
        ),
        cache=CacheConfig(
            num_blocks=max_seqs * 64 + 64,
            enable_prefix_caching=False,
            kv_dtype=kv_dtype,  # type: ignore[arg-type]
        ),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
        runtime=RuntimeConfig(device=device, num_threads=threads, cuda_graphs=cuda_graphs),  # type: ignore[arg-type]
    )
    return EngineCore(config)


def prefill(
    core: EngineCore,
    batch: int,
    tag: str,
    rng: random.Random,
    temperature: float = 0.0,
    prompt_tokens: tuple[int, int] = (300, 600),
) -> list[str]:
    """Add `batch` requests and step until every one has sampled its first token."""
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(*prompt_tokens))]
        params = SamplingParams(max_tokens=256, temperature=temperature, ignore_eos=True)
        core.add_request(Request(request_id=rid, prompt_token_ids=prompt, sampling=params))
        ids.append(rid)
    seen: set[str] = set()
    while len(seen) < batch:
        for delta in core.step():
            seen.add(delta.request_id)
    return ids


def time_steps(core: EngineCore, steps: int, batch: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        deltas = core.step()
        times.append(time.perf_counter() - start)
        decoded = {d.request_id for d in deltas}
        assert len(decoded) == batch, f"expected {batch} decodes, got {len(decoded)}"
    return times


def time_calls(core: EngineCore) -> collections.Counter[str]:
    """Wall time inside the step's heavy calls (the matmuls, each attention-backend op),
    accumulated into the returned counter; instance and module attributes: no source edits."""
    import dataclasses

    import deepinfer.model.llama as llama
    import deepinfer.model.llama_layers as layers

    spent: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    for module in (llama, layers):  # the LM head's, and every other quantized matmul's
        module.block_linear = timed("block_linear", module.block_linear)  # type: ignore[assignment]
    model = core.runner.model
    ops = model.attention_backend
    names = ("paged_decode_attention", "store_kv", "apply_rotary", "fused_add_rms_norm")
    if dataclasses.is_dataclass(ops):
        wrapped = {n: timed(n, getattr(ops, n)) for n in names}
        model.set_attention_backend(dataclasses.replace(ops, **wrapped))  # type: ignore[type-var]
    return spent


def profile_steps(core: EngineCore, steps: int, batch: int, rows: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(core, steps, batch)
    averages = prof.key_averages()
    phases = [e for e in averages if e.key.startswith("phase:")]
    print(f"  phases (ms per step, CPU total, over {steps} steps):")
    for e in sorted(phases, key=lambda e: -e.cpu_time_total):
        print(f"    {e.key:<22} {e.cpu_time_total / 1e3 / steps:8.2f}")
    ops = [e for e in averages if not e.key.startswith("phase:")]
    total = sum(e.self_cpu_time_total for e in ops)
    print(f"  top ops by self CPU (ms per step; all ops {total / 1e3 / steps:.1f} ms):")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(
            f"    {e.key:<40} {e.self_cpu_time_total / 1e3 / steps:8.2f} "
            f"{e.count // steps:6d} calls"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or a pulled model's name")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=20, help="steps + warmup + profile <= 250")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--quantized-matmul", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--matmul-activations", choices=["float32", "int8"], default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", help="auto, float32, bfloat16, float16")
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--kv-dtype", default="auto", help="auto, float32, float16, bfloat16")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=[300, 600], metavar=("LO", "HI")
    )
    parser.add_argument(
        "--time-calls",
        action="store_true",
        help="ms a step inside matmuls and attention ops (runs layer by layer)",
    )
    parser.add_argument(
        "--layer-by-layer",
        action="store_true",
        help="CPU: no one-call native decoder stack (the A/B of kernels/cpu/llama_layers.c)",
    )
    ns = parser.parse_args()
    core = make_core(
        max(ns.batch), ns.threads, ns.quantized_matmul, ns.device, ns.dtype, ns.cuda_graphs,
        ns.kv_dtype, ns.matmul_activations, ns.model,
    )  # fmt: skip
    core.runner.model.native_layers = not (ns.layer_by_layer or ns.time_calls)
    instrument(core)
    spent = time_calls(core) if ns.time_calls else None
    rng = random.Random(ns.seed)
    quantized = core.info.quantized_bytes
    info = core.info
    print(
        f"torch {torch.__version__}, {info.device} {str(info.dtype).removeprefix('torch.')} "
        f"(KV {str(info.kv_dtype).removeprefix('torch.')}), "
        f"attention {info.attention_backend}, {torch.get_num_threads()} threads, "
        f"decode graphs {info.decode_graph_sizes or 'off'}, "
        f"quantized matmul: {f'{quantized / 1e6:.0f} MB of blocks' if quantized else 'off'}"
        f"{' (int8 activations)' if info.int8_activations else ''}, "
        f"native decoder stack {'on' if core.runner.model.native_layers else 'off'}"
    )
    for batch in ns.batch:
        ids = prefill(core, batch, f"b{batch}", rng, ns.temperature, tuple(ns.prompt_tokens))
        time_steps(core, ns.warmup, batch)
        if spent is not None:
            spent.clear()
        times = time_steps(core, ns.steps, batch)
        med, mean = statistics.median(times) * 1e3, statistics.fmean(times) * 1e3
        print(
            f"B={batch:3d}: median {med:7.2f} ms/step, mean {mean:7.2f}, "
            f"min {min(times) * 1e3:7.2f}  ({batch / (med / 1e3):7.1f} tok/s)"
        )
        for name, seconds in spent.most_common() if spent is not None else ():
            print(f"    inside {name:<24} {seconds / ns.steps * 1e3:7.2f} ms/step")
        if ns.profile_steps:
            profile_steps(core, ns.profile_steps, batch, ns.rows)
        for rid in ids:
            core.abort(rid)
        core.step()


if __name__ == "__main__":
    main()
