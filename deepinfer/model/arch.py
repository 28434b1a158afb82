"""`ModelArch`: the shape of a decoder-only model, read once from the weights' metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer.errors import ModelLoadError

Routing = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]


@dataclass(frozen=True)
class MoEArch:
    """The Mixture-of-Experts FFN of a model's sparse layers: a router picks `top_k` of
    `num_experts` gated-SiLU experts per token and sums their outputs weighted by its gates
    (plus, in Qwen2-MoE, a shared expert every token passes through, sigmoid-gated)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    routing: Routing = "softmax_topk"
    """`softmax_topk`: softmax over every expert's logit (float32), then the top k
    (Mixtral, Qwen-MoE); `topk_softmax`: the top k logits, then a softmax over them alone;
    `sigmoid_topk` (DeepSeek-V3, dots.llm1): each expert's sigmoid score, the top k chosen by
    score plus a learned bias (`score_bias`) within the best `topk_groups` of `num_groups`
    groups, gated by their scores."""
    renormalize: bool = True
    """The top k gates are divided by their sum (Mixtral; Qwen's `norm_topk_prob`)."""
    routed_scaling: float = 1.0
    """Factor on every routed gate (DeepSeek's `routed_scaling_factor`)."""
    shared_intermediate_size: int = 0
    """Width of the shared expert (0: none)."""
    shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(a learned linear of the input)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a plain FFN of `ModelArch.intermediate_size` instead."""
    score_bias: bool = False
    """The router has a per-expert bias added to the scores that choose (never to the gates:
    DeepSeek's `e_score_correction_bias`)."""
    num_groups: int = 1
    """Experts in this many equal groups (`sigmoid_topk`): a group ranks by the sum of its two
    best scores and tokens choose only among the best `topk_groups` groups' experts."""
    topk_groups: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts or self.expert_intermediate_size < 1:
            raise ModelLoadError(
                f"invalid MoE metadata: top_k={self.top_k} of {self.num_experts} experts of "
                f"width {self.expert_intermediate_size}"
            )
        groups, chosen = self.num_groups, self.topk_groups
        if (
            groups < 1
            or self.num_experts % groups
            or not 1 <= chosen <= groups
            or self.top_k > chosen * (self.num_experts // groups)
        ):
            raise ModelLoadError(
                f"invalid MoE metadata: {self.num_experts} experts in {groups} groups, top "
                f"{chosen} groups, top {self.top_k} experts"
            )
        if chosen < groups and self.routing != "sigmoid_topk":
            raise ModelLoadError(
                "expert groups with softmax scores (DeepSeek-V2's group-limited routing) are not "
                "served; only DeepSeek-V3's (sigmoid scores)"
            )


@dataclass(frozen=True)
class YarnRope:
    """YaRN-scaled RoPE (`model/rope.py`): context extended `factor` times past
    `original_max_positions`."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    """cos and sin are scaled by it."""
    truncate: bool = True


@dataclass(frozen=True)
class MLAArch:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a compressed
    latent of `kv_lora_rank` (plus one RoPE key of `qk_rope_head_dim` shared by every head),
    queries from one of `q_lora_rank` (0: a plain projection). A head's key is its
    `qk_nope_head_dim` part and the shared RoPE part (`ModelArch.head_dim` is their sum); its
    value is `v_head_dim` wide."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    interleaved_rope: bool = True
    """The checkpoint's rotary rows are in interleaved pairs (DeepSeek's `rope_interleave`; the
    loader reorders them into halves)."""

    def __post_init__(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(dims) < 1 or self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ModelLoadError(f"invalid latent attention metadata: {self}")
        if self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ModelLoadError("latent attention values wider than its keys are not served")


@dataclass(frozen=True)
class ModelArch:
    """Everything the model code and the KV cache need to know about an architecture.

    Invariants (checked at construction, violations raise `ModelLoadError`): all sizes positive,
    `num_heads` a multiple of `num_kv_heads`, `head_dim` even (rotate-half RoPE).
    """

    architecture: str
    """Registry key: `llama`, `qwen2`, `qwen3`, `gemma3`, `mixtral`, `qwen2_moe`, `qwen3_moe`,
    `dots1`, `deepseek_v3`."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    """The LM head reuses the token embedding matrix."""
    qkv_bias: bool = False
    """Q, K and V projections carry biases (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)."""
    layer_windows: tuple[int, ...] = ()
    """Per layer, the sliding window its queries attend (a query at position p sees keys
    p - window + 1..p), 0 for full attention; empty: every layer full (Gemma 3: five windowed
    layers, then a full one)."""
    rope_local_theta: float | None = None
    """RoPE base of the windowed layers (None: `rope_theta`, as the full layers)."""
    query_scale: float | None = None
    """Attention logits' scale (None: 1 / sqrt(head_dim))."""
    moe: MoEArch | None = None
    """The experts of the sparse layers (None: every layer has a dense FFN)."""
    mla: MLAArch | None = None
    """Latent attention in every layer (None: grouped-query attention)."""
    rope_yarn: YarnRope | None = None
    """YaRN scaling of the full layers' RoPE (None: plain)."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint stores after the decoder's (DeepSeek-V3's
    `num_nextn_predict_layers`, at layer indices from `num_layers`): the model does not run
    them; `--speculative mtp` drafts with the first (`model/mtp.py`)."""

    tensor_parallel_shard: bool = False
    """One tensor-parallel rank's share of the model (`loading/sharding.py`): the heads and FFN
    features it holds, which may be no heads at all (a rank past the KV heads)."""

    def __post_init__(self) -> None:
        sizes = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        headless = self.tensor_parallel_shard and self.num_heads == self.num_kv_heads == 0
        bad = [
            f"{name}={value}"
            for name, value in sizes.items()
            if value <= 0 and not (headless and name in ("num_heads", "num_kv_heads"))
        ]
        if bad:
            raise ModelLoadError(f"invalid model metadata: {', '.join(bad)} must be positive")
        if not headless and self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"invalid model metadata: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"invalid model metadata: head_dim={self.head_dim} must be even")
        if self.layer_windows and (
            len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0
        ):
            raise ModelLoadError(
                f"invalid model metadata: {len(self.layer_windows)} layer windows for "
                f"{self.num_layers} layers (each 0 for full attention or a window >= 1)"
            )

    def sparse(self, layer: int) -> bool:
        """Layer `layer`'s FFN is a Mixture of Experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends the whole context."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def windowed(self) -> bool:
        """Some layer attends a sliding window."""
        return any(self.layer_windows)

    @property
    def rotary_dim(self) -> int:
        """Width of the part of a head RoPE rotates (all of it but in latent attention)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim
