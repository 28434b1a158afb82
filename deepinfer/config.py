"""The one frozen configuration, composed from one record per concern.

`Config` is built once (from CLI flags, `DEEPINFER_*` environment variables, or code) and never
mutated. Components copy the few fields they need. Values discovered at run time (the number of KV
blocks that fit, the model's context length) live in `RuntimeInfo` records, never here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Literal

from deepinfer.environment import default_model_path, resolve_model
from deepinfer.errors import ConfigError
from deepinfer.server_config import ServerConfig


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
Bf16Prefill = Literal["auto", "on", "off"]
CudaGraphsMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = None
    """GGUF file or Hugging Face directory (config.json + safetensors), or the name of a model
    `deepinfer pull` fetched (`gemma3-270m`); None: the default model.
    `null` (or `null:PATH.gguf`): the null model, the default model's (or that file's) tokenizer
    and chat format over a forward pass that costs nothing, for measuring the serving path."""
    dtype: DType = "auto"
    """Serving dtype: `auto` is float32 on CPU and bfloat16 on CUDA."""
    max_model_len: int | None = None
    """Cap on context length in tokens; None: the model's own."""
    quantized_matmul: QuantizedMatmul = "auto"
    """Serve a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K matrices in their blocks through
    the native CPU kernel (float32 on CPU only): `auto` when it builds here, `on` (an error if it
    cannot), `off`."""
    matmul_activations: MatmulActivations = "auto"
    """What the quantized kernel multiplies the blocks by: `int8` quantizes each row of
    activations to int8 blocks of 32 and sums integer dot products, as llama.cpp does on CPU
    (1.5-3x faster matmuls; perplexity and KL divergence from float32 as llama.cpp's on the same
    file, bench/RESULTS.md); `float32` the exact fp32 weights by fp32 activations, the numerics
    of transformers on the same file (greedy answers differ where the top two tokens are close);
    `auto` (the default) `int8` wherever the quantized kernel serves the model, else float32."""
    bf16_prefill: Bf16Prefill = "auto"
    """Products of 256 rows or more (long prefill chunks) by int8-served matrices run instead as
    bfloat16 tiles of the weight through torch's matmul (AMX or AVX-512 BF16), the weights exact
    to bf16 rounding; prefill chunks with 1024 tokens of context or more attend in bf16 (float32
    sums). Where AMX runs: 1.6-2.2x the int8 kernel's rate on the 1.5B model's projections,
    2.7x attention's, a 4.6k-token prompt prefilled 1.9x faster, perplexity as before
    (bench/RESULTS.md). `auto`: a probe at start (a child process) decides, its verdict kept in
    `~/.cache/deepinfer/bf16_probe.json` for the next start on the same machine: attention in
    bf16 where bf16 matmuls run at least twice float32's rate, and tiles for each block format
    whose matrices they multiply at least 1.1x as fast as the int8 kernel (on a Zen 5 EPYC
    they lose on Q4_K); `on`: both, always; `off`: never. Never in batch-invariant mode."""
    batch_invariant: bool = False
    """The same request gives bitwise the same tokens and logprobs whatever else runs beside
    it, however its prompt is chunked and wherever its prefix comes from (computed, or the
    device, host or disk tier): every query row's attention takes the one-row kernel's fixed
    order (so a prompt costs more to compute). Needs the native CPU kernels and every matrix
    served by the quantized kernel (a GGUF model on CPU); start-up refuses it elsewhere."""

    def resolved_path(self) -> Path:
        return resolve_model(self.path) if self.path is not None else default_model_path()


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
    else; it is reserved, not touched: resident memory grows with the blocks written, up to the
    budget); on CUDA 80% of the device memory free once the weights are loaded."""
    num_blocks: int | None = None
    """Exact number of KV blocks (overrides the byte budget; tests use it)."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests with identical prefixes (chained block hashes)."""
    window_kv: Literal["window", "all"] = "window"
    """A model with sliding-window layers (Gemma 3): `window` keeps only each request's window
    of their KV, in a pool of their own (freed as the window slides); prefix hits rebuild it
    from a stored window or by a bounded replay, and the host and disk tiers store the full
    layers' KV alone. `all` keeps every token in every layer (and caches every layer). With
    separate prefill and decode device groups or a worker-side draft (`--speculative layers`,
    `draft-model`, `mtp`), `all` is used (logged)."""


@dataclass(frozen=True)
class DiskCacheConfig:
    """The disk tier of the prefix cache: KV blocks kept for days, across restarts."""

    enabled: bool = True
    """Keep full blocks on disk across restarts; off: the prefix cache lives in memory only."""
    cache_dir: Path | None = None
    """Cache root; None: `$XDG_CACHE_HOME/deepinfer` or `~/.cache/deepinfer`."""
    max_bytes: int = 32 << 30
    """Byte budget on disk; LRU eviction beyond it (lowered while the filesystem is full)."""
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


KVEventsHash = Literal["int64", "bytes"]


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events for cache-aware routers, in vLLM's format (ZMQ PUB, msgpack)."""

    kv_events_endpoint: str | None = None
    """ZMQ address that publishes every tier's block stores and removals (e.g.
    `tcp://*:5557`: bound when it holds `*`, else connected); None: off."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER address where a subscriber asks for batches it missed (e.g. `tcp://*:5558`)."""
    kv_events_topic: str = ""
    """Topic frame of every published batch."""
    kv_events_block_hash: KVEventsHash = "int64"
    """Block hashes on the wire: `int64`, the lower 64 bits of our sha256 block hash read
    big-endian (vLLM's default); `bytes`, the 32 bytes."""
    kv_events_buffer_steps: int = 10_000
    """Batches kept for replay."""
    kv_events_hwm: int = 100_000
    """High-water mark of the PUB socket: messages past it are dropped for a slow subscriber."""
    kv_events_max_queue_size: int = 100_000
    """Block entries recorded and not yet published; more are dropped and counted."""


KVTransferKind = Literal["off", "nixl"]
KVRole = Literal["producer", "consumer", "both"]


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill and decode on different replicas: a prompt's KV moved between processes or
    machines by NIXL (UCX: TCP or shared memory on CPU, RDMA/NVLink where present), driven by
    vLLM's `kv_transfer_params` fields so `vllm-router --vllm-pd-disaggregation` drives it."""

    kv_transfer: KVTransferKind = "off"
    """`nixl`: take part in KV transfers (`pip install nixl`); `off`: requests' transfer
    fields are ignored."""
    kv_role: KVRole = "both"
    """`producer`: prefills and keeps the prompt's blocks for a consumer to pull; `consumer`:
    pulls a prefilled prompt's blocks before decoding; `both`."""
    kv_transfer_host: str = "127.0.0.1"
    """Address this replica's transfer side channel binds and tells consumers."""
    kv_transfer_port: int = 0
    """Port of the side channel (0: any free port; responses carry the one bound)."""
    kv_transfer_hold_s: float = 120.0
    """How long a producer keeps a prompt's blocks for a consumer that does not pull them."""
    kv_transfer_timeout_s: float = 30.0
    """How long a consumer waits for a handshake or a pull before computing the prompt itself."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running (holding KV blocks) at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step: decodes plus prefill chunks."""
    max_waiting: int = 1024
    """Most requests queued before new ones are refused (overload)."""
    stream_frames_per_step: int = 16
    """Streams a step wakes at every token; past that, each stream's reader is woken once for
    ceil(streams / this) tokens (fewer, larger deltas; the same text). 0: every token."""
    stream_max_delay_ms: float = 50.0
    """Longest a token waits for its stream's reader when tokens are gathered into frames."""


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output's grammars: each new one is built first in a child process."""

    grammar_compile_timeout_s: float = 10.0
    """Seconds a new grammar may take to build; past it (or when building crashes the child
    process that tries it first) the request gets a 400, and a repeat is refused at once."""
    grammar_cache_mb: int = 512
    """MiB the compiled grammars kept for reuse may hold together (each measured as it is
    first built); the least recently used go first."""


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
    ~0.1-0.2 s a step, so shorter steps waste most of their time), 2 s on CPU where the model
    takes long chunks' products as bf16 tiles (`bf16_prefill`: they pay from 256 rows)."""
    prefill_buckets: tuple[int, ...] = (512, 4096, 32768)
    """Upper bounds of the uncached-prompt-length buckets (one more bucket holds the rest)."""
    prefill_max_batched_tokens: int = 16384
    """Most prompt tokens in one prefill step, whatever the time budget allows."""
    gc_young_threshold: int | None = 50_000
    """While the engine runs, what exists at its start is frozen out of Python's cyclic garbage
    collection and the youngest generation is collected every this many allocations (Python's
    default: 700); restored at shutdown. None: leave the collector as it is. See
    `engine/process_settings.py`."""
    gil_switch_interval_ms: float | None = 0.5
    """While the engine runs, Python's GIL switch interval (`sys.setswitchinterval`; restored at
    shutdown); None: leave Python's 5 ms. A forward pass drops and retakes the GIL at every op
    or launch, and each retake can wait a whole interval while the event loop's thread is busy
    streaming: on a GPU, hundreds of launches a step turn into seconds. On CPU 0.5 ms gave 4%
    more throughput at 32 streams (bench/RESULTS.md)."""


SPECULATIVE_METHODS = ("none", "ngram", "suffix", "auto", "layers", "draft-model", "mtp")
MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies a request's draft tokens along with its
    next token, in one forward pass, and keeps the drafts the model agrees with (the output is
    the same tokens as without it, greedy or seeded; requests with a grammar draft too: each
    verified position has its own mask)."""

    speculative: Literal["none", "ngram", "suffix", "auto", "layers", "draft-model", "mtp"] = "none"
    """How drafts are proposed: `none`; `ngram` (prompt lookup: the request's own context
    continues its longest recent n-gram match; no extra model); `suffix` (suffix decoding: the
    most frequent continuation of the context's tail in the request's own tokens and in its
    tenant's recent outputs, the draft as long as the match and its frequency warrant); `auto`
    (`suffix` or `ngram`, or `mtp` where the model has the layer and one device group,
    whichever's drafts would have kept more of each request's recent tokens; the gate verifies
    them only where they pay); `layers` (self-speculation: the
    model's first `draft_layers` layers, its final norm and LM head draft greedily, on the
    worker, at the start of the step that verifies them); `draft-model` (a smaller model with
    the same vocabulary, `draft_model`, drafts greedily on the worker, its KV in the same
    blocks as the model's); `mtp` (the checkpoint's multi-token-prediction layer, DeepSeek-V3's
    `num_nextn_predict_layers`, drafts greedily on the worker from the model's hidden states;
    one device group)."""
    num_draft_tokens: int = 5
    """Most draft tokens a request verifies in one step (`ngram`, `layers`, `draft-model`,
    `mtp`; suffix decoding and a request's prediction size their own drafts, up to 15, and the
    gate cuts every draft to what pays)."""
    draft_layers: int = 8
    """`layers`: how many of the model's first layers draft (fewer than it has)."""
    draft_model: str | None = None
    """`draft-model`: the draft's GGUF file or model directory, or a pulled model's name (its
    vocabulary must be the model's)."""
    speculative_gate: Literal["on", "off"] = "on"
    """`on`: each step verifies only the drafts expected to pay for their cost (acceptance
    predicted by a logistic model fitted online, step costs from the decode cost model); `off`:
    every draft (the baseline)."""


EXPERT_PARALLEL_BACKENDS = ("local", "gloo", "nccl")


@dataclass(frozen=True)
class ExpertsConfig:
    """Mixture of Experts: where each sparse layer's experts run, and the load balancer (dense
    models ignore this section)."""

    expert_parallel: int = 1
    """Groups each sparse layer's experts are placed over (each group computes the rows of the
    experts it holds; outputs do not depend on the number)."""
    expert_parallel_backend: Literal["local", "gloo", "nccl"] = "local"
    """`local`: the groups are devices of this process (`--expert-devices`), each computing on
    a thread of its own; `gloo` (CPU) / `nccl` (GPUs): group g is torch.distributed rank g, a
    process that runs expert layers only (rank 0 serves: API, scheduler, cache)."""
    expert_devices: tuple[str, ...] = ()
    """`local`: one device per group; empty: on CUDA one GPU per group when there are enough,
    else every group on the runtime device (CPU thread groups)."""
    redundant_experts: int = 0
    """Extra expert slots over all groups, given to the hottest experts as replicas (their
    tokens split among the replicas); experts plus these must divide evenly into groups."""
    eplb_interval: int = 0
    """Forward steps between placements recomputed from the load since the last one (0: the
    placement never changes)."""
    nnodes: int = 1
    """Machines the expert-parallel (`gloo`/`nccl`) or tensor-parallel processes span, as
    torchrun's flag."""
    node_rank: int = 0
    """This machine's rank: 0 serves and starts its share of the ranks; another starts its
    share of the ranks only."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the ranks meet (torch.distributed's TCP rendezvous)."""
    master_port: int = 29500
    """Port of that rendezvous."""


@dataclass(frozen=True)
class TensorParallelConfig:
    """A model's layers split over processes, Megatron-style: each rank holds a run of the
    attention heads (and their KV) and of the FFN's features (a Mixture of Experts: a run of
    its experts, with `--expert-parallel` N over the same ranks), and adds its partial outputs
    to the others' (one all-reduce after each attention and FFN block). Rank 0 serves (API,
    scheduler, caches); the ranks meet as the expert-parallel ones do (`--nnodes`,
    `--node-rank`, `--master-addr`, `--master-port`)."""

    tensor_parallel: int = 1
    """Ranks each layer is split over (at most the model's attention heads; ranks past its KV
    heads hold no heads, only their share of the FFN)."""
    tensor_parallel_backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed's backend: `gloo` (CPU), `nccl` (one GPU per rank)."""


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
    """Replay steps from CUDA graphs: decode steps whole (on CUDA with the Triton backend),
    prefill steps piecewise by token bucket (on CUDA, Llama-family decoders): `auto` where they
    can be, `on` (an error where they cannot), `off` (eager)."""
    seed: int = 0
    """Seed for requests that give none."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    disk_cache: DiskCacheConfig = field(default_factory=DiskCacheConfig)
    host_cache: HostCacheConfig = field(default_factory=HostCacheConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **sections: object) -> Config:
        """A copy with whole sections replaced (configs are frozen)."""
        return dataclasses.replace(self, **sections)  # type: ignore[arg-type]


def _validate(config: Config) -> None:
    _validate_workers(config.workers)
    g = config.grammar
    if g.grammar_compile_timeout_s <= 0 or g.grammar_cache_mb < 0:
        raise ConfigError(
            "grammar_compile_timeout_s must be positive and grammar_cache_mb not negative"
        )
    _validate_speculative(config.speculative)
    _validate_experts(config.experts)
    _validate_tensor_parallel(config)
    c, s = config.cache, config.scheduler
    if c.block_size <= 0 or c.block_size & (c.block_size - 1):
        raise ConfigError(f"cache.block_size must be a positive power of two, got {c.block_size}")
    if c.num_blocks is not None and c.num_blocks < 2:
        raise ConfigError(f"cache.num_blocks must be at least 2, got {c.num_blocks}")
    if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
        raise ConfigError("scheduler.max_num_seqs and max_num_batched_tokens must be positive")
    if s.max_waiting < 1:  # else every request is refused as overload, forever
        raise ConfigError(f"scheduler.max_waiting must be at least 1, got {s.max_waiting}")
    if config.model.max_model_len is not None and config.model.max_model_len < 1:
        raise ConfigError("model.max_model_len must be positive")
    if config.model.bf16_prefill not in ("auto", "on", "off"):
        raise ConfigError(
            f"model.bf16_prefill must be auto, on or off, got {config.model.bf16_prefill!r}"
        )
    if config.model.bf16_prefill == "on" and config.model.batch_invariant:
        raise ConfigError(
            "model.bf16_prefill on: not in batch-invariant mode (its rows change the numerics)"
        )
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
    e = config.kv_events
    if e.kv_events_block_hash not in ("int64", "bytes"):
        raise ConfigError(
            f"kv_events_block_hash must be int64 or bytes, got {e.kv_events_block_hash!r}"
        )
    if min(e.kv_events_buffer_steps, e.kv_events_hwm, e.kv_events_max_queue_size) < 1:
        raise ConfigError("kv_events buffer_steps, hwm and max_queue_size must be positive")
    t = config.kv_transfer
    if t.kv_transfer not in ("off", "nixl") or t.kv_role not in ("producer", "consumer", "both"):
        raise ConfigError(
            f"kv_transfer must be off or nixl and kv_role producer, consumer or both, got "
            f"{t.kv_transfer!r} and {t.kv_role!r}"
        )
    if t.kv_transfer_hold_s <= 0 or t.kv_transfer_timeout_s <= 0 or t.kv_transfer_port < 0:
        raise ConfigError("kv_transfer hold and timeout must be positive and the port not negative")
    if t.kv_transfer != "off" and not config.cache.enable_prefix_caching:
        raise ConfigError("--kv-transfer needs the prefix cache: pulled blocks are prefix hits")
    h = config.host_cache
    if h.enabled not in ("auto", "on", "off"):
        raise ConfigError(f"host_cache.enabled must be auto, on or off, got {h.enabled!r}")
    if h.max_bytes < 1 << 20:
        raise ConfigError("host_cache.max_bytes must be >= 1 MiB (or turn the host cache off)")


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


def _validate_tensor_parallel(config: Config) -> None:
    """The tensor-parallel flags, and what they compose with: experts over the same ranks
    (static placement), no KV transfer yet."""
    tp = config.tensor_parallel
    if tp.tensor_parallel < 1 or tp.tensor_parallel_backend not in ("gloo", "nccl"):
        raise ConfigError("tensor_parallel must be at least 1, its backend gloo or nccl")
    ep = config.experts
    if (
        tp.tensor_parallel > 1
        and ep.expert_parallel > 1
        and (
            ep.expert_parallel != tp.tensor_parallel
            or ep.redundant_experts
            or ep.eplb_interval
            or ep.expert_devices
            or ep.expert_parallel_backend not in ("local", tp.tensor_parallel_backend)
        )
    ):
        raise ConfigError(
            f"--tensor-parallel {tp.tensor_parallel} with --expert-parallel: the experts go over "
            f"the same ranks (--expert-parallel {tp.tensor_parallel}, one expert each place: no "
            "--redundant-experts, --eplb-interval or --expert-devices)"
        )
    if tp.tensor_parallel > 1 and config.kv_transfer.kv_transfer != "off":
        raise ConfigError("--tensor-parallel with --kv-transfer: not yet, one or the other")


def _validate_experts(e: ExpertsConfig) -> None:
    if e.expert_parallel_backend not in EXPERT_PARALLEL_BACKENDS:
        raise ConfigError(
            f"expert_parallel_backend must be one of {', '.join(EXPERT_PARALLEL_BACKENDS)}, "
            f"got {e.expert_parallel_backend!r}"
        )
    if e.expert_parallel < 1 or e.nnodes < 1 or e.node_rank < 0:
        raise ConfigError("expert_parallel and nnodes must be at least 1, node_rank at least 0")
    if e.redundant_experts < 0 or e.eplb_interval < 0:
        raise ConfigError("redundant_experts and eplb_interval must be at least 0")
    if not 0 < e.master_port < 65536:
        raise ConfigError(f"--master-port must be a TCP port, got {e.master_port}")


def check_expert_layout(e: ExpertsConfig) -> None:
    """The expert-parallel flags agree with each other (checked where they are used: each
    flag alone is valid)."""
    if e.expert_devices and len(e.expert_devices) != e.expert_parallel:
        raise ConfigError(
            f"--expert-devices names {len(e.expert_devices)} devices for "
            f"--expert-parallel {e.expert_parallel} groups"
        )
    if e.node_rank >= e.nnodes:
        raise ConfigError(f"--node-rank {e.node_rank} is not in [0, --nnodes {e.nnodes})")
    if e.nnodes > 1 and e.expert_parallel_backend == "local":
        raise ConfigError("--nnodes above 1 needs --expert-parallel-backend gloo or nccl")
    if e.expert_parallel % e.nnodes:
        raise ConfigError(
            f"--expert-parallel {e.expert_parallel} does not divide over --nnodes {e.nnodes}"
        )


def _validate_workers(w: WorkersConfig) -> None:
    for name in ("prefill_threads", "decode_threads"):
        value = getattr(w, name)
        if value is not None and value < 1:
            raise ConfigError(f"workers.{name} must be at least 1, got {value}")
    if w.prefill_step_ms is not None and w.prefill_step_ms <= 0:
        raise ConfigError(f"workers.prefill_step_ms must be positive, got {w.prefill_step_ms}")
    if w.prefill_max_batched_tokens < 1:
        raise ConfigError("workers.prefill_max_batched_tokens must be positive")
    if w.gc_young_threshold is not None and w.gc_young_threshold < 1:
        raise ConfigError(
            f"workers.gc_young_threshold must be at least 1 (or None), got {w.gc_young_threshold}"
        )
    if w.gil_switch_interval_ms is not None and not 0 < w.gil_switch_interval_ms <= 100:
        raise ConfigError(
            f"workers.gil_switch_interval_ms must be in (0, 100], got {w.gil_switch_interval_ms}"
        )
