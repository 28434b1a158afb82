"""Command-line flags shared by `deepinfer generate|chat|serve` and server.py -> one `Config`."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    env_overrides,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    env = env_overrides()
    g = parser.add_argument_group("engine")
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
    g.add_argument("--device", default=env.get("device", "auto"), help="auto, cpu, cuda, cuda:N")
    g.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        default=env.get("attention_backend", "auto"),
    )
    g.add_argument("--threads", type=int, default=None, help="torch threads for forward passes")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-memory-gb", type=float, default=1.0, help="memory budget of the KV pool")
    g.add_argument("--num-blocks", type=int, default=None, help="exact KV block count")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-waiting", type=int, default=1024)
    g.add_argument("--seed", type=int, default=0)
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


def config_from_args(ns: argparse.Namespace) -> Config:
    server = ServerConfig()
    if hasattr(ns, "host"):
        server = ServerConfig(
            host=ns.host,
            port=ns.port,
            api_key=ns.api_key,
            served_model_name=ns.served_model_name,
            max_body_bytes=ns.max_body_bytes,
        )
    return Config(
        model=ModelConfig(path=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len),
        disk_cache=DiskCacheConfig(
            enabled=not ns.no_disk_cache,
            cache_dir=ns.cache_dir,
            max_bytes=int(ns.disk_cache_gb * (1 << 30)),
            default_retention=ns.default_retention,
        ),
        cache=CacheConfig(
            block_size=ns.block_size,
            kv_memory_bytes=int(ns.kv_memory_gb * (1 << 30)),
            num_blocks=ns.num_blocks,
            enable_prefix_caching=not ns.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            max_waiting=ns.max_waiting,
        ),
        runtime=RuntimeConfig(
            device=ns.device,
            attention_backend=ns.attention_backend,
            num_threads=ns.threads,
            seed=ns.seed,
        ),
        server=server,
    )
