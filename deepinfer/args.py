"""Command-line flags shared by `deepinfer generate|chat|serve` and server.py -> one `Config`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    HostCacheConfig,
    ModelConfig,
    RequestLimits,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    WorkersConfig,
    env_overrides,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    env = env_overrides()
    g = parser.add_argument_group("engine")
    _add_model_args(g, env)
    _add_kv_pool_args(g)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-waiting", type=int, default=1024)
    g.add_argument("--seed", type=int, default=0)
    _add_tier_args(parser, env)
    add_worker_args(parser)


def _add_model_args(g: argparse._ArgumentGroup, env: dict[str, str]) -> None:
    """The model, its dtype and device, and how its forward pass runs."""
    g.add_argument(
        "--model",
        type=Path,
        default=env.get("model"),
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=env.get("dtype", "auto"),
    )
    g.add_argument("--max-model-len", type=int, default=None, help="cap on context length")
    g.add_argument(
        "--quantized-matmul",
        choices=["auto", "on", "off"],
        default="auto",
        help="CPU: multiply by a GGUF file's Q4_1/Q8_0 blocks with the native kernel (auto: "
        "when a C compiler and AVX2 are there; off: dequantize to the serving dtype)",
    )
    g.add_argument(
        "--matmul-activations",
        choices=["float32", "int8"],
        default="float32",
        help="with --quantized-matmul: float32 (default) keeps transformers' exact arithmetic; "
        "int8 quantizes activations to int8 blocks and sums integer dot products, as llama.cpp "
        "does (faster, slightly different logits)",
    )
    g.add_argument("--device", default=env.get("device", "auto"), help="auto, cpu, cuda, cuda:N")
    g.add_argument(
        "--attention-backend",
        choices=["auto", "cpu", "torch", "triton"],
        default=env.get("attention_backend", "auto"),
    )
    g.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="replay decode steps from CUDA graphs (auto: on CUDA with the Triton backend)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch threads for forward passes")


def _add_kv_pool_args(g: argparse._ArgumentGroup) -> None:
    """The device KV pool: block size, dtype, size, prefix sharing."""
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--kv-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="how K and V are stored (auto: float16 under float32 serving on the CPU backends, "
        "else the serving dtype)",
    )
    g.add_argument(
        "--kv-memory-gb",
        type=float,
        default=None,
        help="memory budget of the KV pool (default: CPU a quarter of RAM up to 4, CUDA 1)",
    )
    g.add_argument("--num-blocks", type=int, default=None, help="exact KV block count")
    g.add_argument("--no-prefix-caching", action="store_true")


def _add_tier_args(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """The prefix cache's lower tiers: disk, and host RAM."""
    d = parser.add_argument_group("disk cache")
    d.add_argument(
        "--cache-dir",
        type=Path,
        default=env.get("cache_dir"),
        help="disk KV cache root (default: ~/.cache/deepinfer)",
    )
    d.add_argument(
        "--no-disk-cache", action="store_true", help="keep the prefix cache in memory only"
    )
    d.add_argument("--disk-cache-gb", type=float, default=32.0, help="disk KV cache byte budget")
    d.add_argument(
        "--default-retention",
        choices=["agent", "chat", "none"],
        default=env.get("default_retention", "chat"),
    )
    h = parser.add_argument_group("host cache")
    h.add_argument(
        "--host-cache",
        choices=["auto", "on", "off"],
        default=env.get("host_cache", "auto"),
        help="host-RAM KV tier between device and disk (auto: on with CUDA, off on CPU)",
    )
    h.add_argument("--no-host-cache", action="store_true", help="same as --host-cache off")
    h.add_argument("--host-cache-gb", type=float, default=8.0, help="host KV cache byte budget")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("prefill and decode workers")
    w.add_argument(
        "--colocated",
        action="store_true",
        help="one worker mixing prefill chunks into decode steps (the baseline)",
    )
    w.add_argument("--prefill-devices", default="", help="the prefill worker's device, e.g. cuda:0")
    w.add_argument(
        "--decode-devices",
        default="",
        help="the decode worker's device, e.g. cuda:1: its own model replica and KV pool",
    )
    w.add_argument("--prefill-threads", type=int, default=None, help="CPU threads of prefill")
    w.add_argument("--decode-threads", type=int, default=None, help="CPU threads of decode")
    w.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=0.5,
        help="Python's GIL switch interval while the engine runs (0: leave Python's 5 ms)",
    )
    w.add_argument(
        "--lend-idle-threads",
        action="store_true",
        help="CPU: a worker borrows its idle peer's cores (throughput over steady latency)",
    )
    w.add_argument(
        "--prefill-step-ms", type=float, default=None, help="time budget of a prefill step"
    )
    w.add_argument(
        "--prefill-buckets",
        default="512,4096,32768",
        help="upper bounds of the uncached prompt length buckets",
    )


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def workers_from_args(ns: argparse.Namespace) -> WorkersConfig:
    try:
        buckets = tuple(int(b) for b in _csv(ns.prefill_buckets))
    except ValueError:
        raise SystemExit(f"--prefill-buckets takes integers, got {ns.prefill_buckets!r}") from None
    return WorkersConfig(
        colocated=ns.colocated,
        prefill_devices=_csv(ns.prefill_devices),
        decode_devices=_csv(ns.decode_devices),
        prefill_threads=ns.prefill_threads,
        decode_threads=ns.decode_threads,
        lend_idle_threads=ns.lend_idle_threads,
        gil_switch_interval_ms=ns.gil_switch_interval_ms or None,
        prefill_step_ms=ns.prefill_step_ms,
        prefill_buckets=buckets,
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    env = env_overrides()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=env.get("host", "127.0.0.1"))
    g.add_argument("--port", type=int, default=int(env.get("port", "8000")))
    g.add_argument(
        "--api-key", default=env.get("api_key"), help="require this key on every request"
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--max-body-bytes", type=int, default=4 << 20)
    d = ServerConfig()
    g.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s)
    g.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s)
    g.add_argument("--keep-alive-timeout-s", type=float, default=d.keep_alive_timeout_s)
    g.add_argument("--max-connections", type=int, default=d.max_connections)
    limits = parser.add_argument_group("request limits (each refused with a 400 naming it)")
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument(
            "--" + f.name.replace("_", "-"), type=int, default=getattr(d.limits, f.name)
        )


def config_from_args(ns: argparse.Namespace) -> Config:
    server = ServerConfig()
    if hasattr(ns, "host"):
        server = ServerConfig(
            host=ns.host,
            port=ns.port,
            api_key=ns.api_key,
            served_model_name=ns.served_model_name,
            max_body_bytes=ns.max_body_bytes,
            limits=RequestLimits(
                **{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestLimits)}
            ),
            header_timeout_s=ns.header_timeout_s,
            body_timeout_s=ns.body_timeout_s,
            keep_alive_timeout_s=ns.keep_alive_timeout_s,
            max_connections=ns.max_connections,
        )
    return Config(
        model=ModelConfig(
            path=ns.model,
            dtype=ns.dtype,
            max_model_len=ns.max_model_len,
            quantized_matmul=ns.quantized_matmul,
            matmul_activations=ns.matmul_activations,
        ),
        disk_cache=DiskCacheConfig(
            enabled=not ns.no_disk_cache,
            cache_dir=ns.cache_dir,
            max_bytes=int(ns.disk_cache_gb * (1 << 30)),
            default_retention=ns.default_retention,
        ),
        host_cache=HostCacheConfig(
            enabled="off" if ns.no_host_cache else ns.host_cache,
            max_bytes=int(ns.host_cache_gb * (1 << 30)),
        ),
        cache=CacheConfig(
            block_size=ns.block_size,
            kv_dtype=ns.kv_dtype,
            kv_memory_bytes=None if ns.kv_memory_gb is None else int(ns.kv_memory_gb * (1 << 30)),
            num_blocks=ns.num_blocks,
            enable_prefix_caching=not ns.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            max_waiting=ns.max_waiting,
        ),
        workers=workers_from_args(ns),
        runtime=RuntimeConfig(
            device=ns.device,
            attention_backend=ns.attention_backend,
            cuda_graphs=ns.cuda_graphs,
            num_threads=ns.threads,
            seed=ns.seed,
        ),
        server=server,
    )
