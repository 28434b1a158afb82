"""The Llama-family decoder (Llama, Qwen2 with QKV bias, Qwen3 with per-head q/k RMSNorm; any
layer may attend a sliding window, with a RoPE base of its own).

Parameters are fused for fewer, larger matmuls: `qkv_proj` rows are [q; k; v] and `gate_up_proj`
rows are [gate; up], in Hugging Face's (rotate-half RoPE) layout. The model is built on the meta
device and receives its weights through `load_state_dict(..., assign=True)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.int8_matmul import BlockWeight, block_linear
from deepinfer.kernels.llama_layers_cpu import (
    LayerWeights,
    NativeLayerStack,
    StackShape,
    step_applies,
)
from deepinfer.kernels.rotary_torch import rotary_cos_sin
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend, torch_backend
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches, check_kv_caches

# Re-exported for callers that import the KV helpers next to the model.
from deepinfer.model.kv_layout import allocate_kv_caches as allocate_kv_caches
from deepinfer.model.kv_layout import kv_bytes_per_block as kv_bytes_per_block
from deepinfer.model.rope import rope_table
from deepinfer.model.step_context import StepContext, step_context

_TRANSPOSED_ROWS = range(2, 65)
"""Row counts for which CPU matmuls run as W @ x^T (see `cpu_aware_linear`)."""


def cpu_aware_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    contiguous: bool = True,
) -> torch.Tensor:  # [M, in] -> [M, out]
    """`F.linear`, except that on CPU a product of 2-64 rows runs as W @ x^T: MKL packs the whole
    weight on every x @ W^T call, which dominates at few rows. Measured on these 2-core AVX2
    machines over 30 layers of distinct weights: 2.4x faster at 2-4 rows, 1.5x at 32; the
    49152-row LM head 1.6x at 32 rows. One row (GEMV) and long prefill chunks keep `F.linear`."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] not in _TRANSPOSED_ROWS:
        return F.linear(x, weight, bias)
    out = (weight @ x.t()).t()  # [M, out], transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous() if contiguous else out


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) through `cpu_aware_linear`, or through
    the native quantized kernel once `quantize` has swapped its weight for GGUF blocks."""

    quantized: BlockWeight | None = None

    def quantize(self, weight: BlockWeight) -> None:
        """Serve from `weight` (the same values as `self.weight`, in blocks) and drop the fp32
        copy."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.out_features}x{weight.in_features} weight for {self}")
        self.quantized = weight
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = block_linear(x, self.quantized)
            return out if self.bias is None else out + self.bias
        return cpu_aware_linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """`nn.Embedding` without the random init: its weight always comes from the checkpoint, and
    `normal_` on the meta device runs through torch's Python references, whose first call imports
    `torch._dynamo` (and with it Triton, where installed) even on the CPU path."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Holds the weight only: the kernel backend computes the norm."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.arch = arch
        self.window = arch.window(layer)
        """This layer's sliding window (None: it attends the whole context)."""
        self.qkv_proj = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.qkv_bias)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim)
            self.k_norm = RMSNorm(arch.head_dim)
        self.scale = arch.attention_scale

    def project(
        self, h: torch.Tensor, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, H, D], [T, Hkv, D] x 2
        """This step's queries, keys and values, rotated (what attention reads and stores)."""
        a, ops = self.arch, step.ops
        num_tokens = h.shape[0]
        qkv = self.qkv_proj(h)  # [T, (H + 2 Hkv) D]
        # q, k and v stay views of qkv (unit last stride, any row stride): every kernel takes them.
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(num_tokens, a.num_heads, a.head_dim)  # [T, H, D]
        k = k.view(num_tokens, a.num_kv_heads, a.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = ops.rms_norm(q, self.q_norm.weight, a.rms_norm_eps)
            k = ops.rms_norm(k, self.k_norm.weight, a.rms_norm_eps)
        local = step.cos_sin_local if self.window else step.cos_sin
        ops.apply_rotary(q, k, step.batch.positions, local)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, hidden]
        return self.o_proj(out.reshape(out.shape[0], self.arch.q_size))


def paged_attention(
    step: StepContext,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]: this step's keys and values, stored first
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, H, D]
    """Store the step's K/V in a layer's cache, then attend each query over its context (the
    windowed pool's tables and plan for a layer with a `window`)."""
    ops, batch = step.ops, step.batch
    k_cache, v_cache = kv_cache
    windowed = window is not None
    slots, tables = batch.group(windowed)
    plan, lens = step.attention_plan(windowed), batch.context_lens
    ops.store_kv(k, v, k_cache, v_cache, slots)
    if batch.is_decode_only:  # T == B: one query per request
        return ops.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, plan=plan, window=window
        )
    return ops.paged_prefill_attention(
        q, k_cache, v_cache, tables, batch.query_start_loc, lens, scale, plan=plan, window=window
    )


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(h)))  # [T, 2I] -> [T, I] -> [T, D]


class DecoderLayer(nn.Module):
    """A decoder layer, `layer(h, residual, kv_cache, step) -> (output, residual)`: the residual
    stream is None before the first layer, and each layer returns it before its own output is
    added.

    A layer is its attention's input (`attention_input`: norms and projections up to the rotated
    q, k and v), the paged attention itself, then what follows it (`attention_output`: the output
    projection, norms, the FFN): prefill CUDA graphs capture the two pieces apart, attention
    running eagerly between them (`model/piecewise.py`)."""

    self_attn: LlamaAttention

    def attention_input(
        self, h: torch.Tensor, residual: torch.Tensor | None, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, the residual stream including the last layer's output)."""
        raise NotImplementedError

    def attention_output(
        self, out: torch.Tensor, residual: torch.Tensor, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added) from attention's
        output [T, H, D]."""
        raise NotImplementedError

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.attention_input(h, residual, step)
        attn = self.self_attn
        out = paged_attention(step, q, k, v, kv_cache, attn.scale, attn.window)
        return self.attention_output(out, residual, step)

    def native_weights(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor
    ) -> LayerWeights:
        """This layer as the native stack computes it (`cos_sin`: its RoPE table); ValueError
        where the stack cannot."""
        raise NotImplementedError

    @staticmethod
    def add_and_norm_input(
        ops: AttentionBackend,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's normed input, the residual stream including the last layer's output)."""
        if residual is None:
            return ops.rms_norm(h, weight, eps), h
        return ops.fused_add_rms_norm(h, residual, weight, eps)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.input_norm = RMSNorm(arch.hidden_size)
        self.self_attn = LlamaAttention(arch, layer)
        self.post_attention_norm = RMSNorm(arch.hidden_size)
        self.mlp = LlamaMLP(arch)

    def attention_input(
        self, h: torch.Tensor, residual: torch.Tensor | None, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ops = step.ops
        h, residual = self.add_and_norm_input(ops, h, residual, self.input_norm.weight, self.eps)
        return (*self.self_attn.project(h, step), residual)

    def attention_output(
        self, out: torch.Tensor, residual: torch.Tensor, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = step.ops
        h = self.self_attn.output(out)
        h, residual = ops.fused_add_rms_norm(h, residual, self.post_attention_norm.weight, self.eps)
        return self.mlp(h, ops), residual

    def native_weights(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor
    ) -> LayerWeights:
        return native_layer_weights(
            self.self_attn, self.mlp, self.input_norm, self.post_attention_norm, kv_cache, cos_sin
        )


def native_layer_weights(
    attn: LlamaAttention,
    mlp: LlamaMLP,
    input_norm: RMSNorm,
    post_norm: RMSNorm,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    cos_sin: torch.Tensor,
) -> LayerWeights:
    """A Llama-family layer's attention and MLP with the norms before them, for the native stack
    (a Qwen3 or Gemma 3 layer's q/k norms included)."""
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.bias is not None for lin in linears):
        raise ValueError("the native stack has no matmul biases")
    qkv, o, gate_up, down = (lin.quantized for lin in linears)
    if qkv is None or o is None or gate_up is None or down is None:
        raise ValueError("every matmul must be served by a quantized kernel")
    q_norm = k_norm = None
    if attn.arch.qk_norm:
        q_norm, k_norm = attn.q_norm.weight.data, attn.k_norm.weight.data
    return LayerWeights(
        qkv, o, gate_up, down, input_norm.weight.data, post_norm.weight.data, *kv_cache,
        cos_sin=cos_sin, window=attn.window or 0, q_norm=q_norm, k_norm=k_norm,
    )  # fmt: skip


class LlamaForCausalLM(nn.Module):
    """`model(batch) -> logits [B_sample, V]` (float32), only for `batch.logits_indices` rows.

    KV caches are bound once with `bind_kv_caches`; each forward writes the batch's new K/V into
    them at `batch.slot_mapping` and reads each request's context through its block table.
    """

    cos_sin: torch.Tensor  # [P, D], a buffer
    cos_sin_local: torch.Tensor  # [P, D], a buffer: the windowed layers' (`cos_sin` if shared)
    decoder_layer: type[DecoderLayer] = LlamaDecoderLayer
    """The layer class, built as `decoder_layer(arch, index)`."""

    def __init__(
        self, arch: ModelArch, device: torch.device, backend: AttentionBackend | None = None
    ) -> None:
        super().__init__()
        self.arch = arch
        with torch.device("meta"):
            self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
            self.layers = nn.ModuleList(self.decoder_layer(arch, i) for i in range(arch.num_layers))
            self.norm = RMSNorm(arch.hidden_size)
            self.lm_head = (
                None
                if arch.tie_word_embeddings
                else Linear(arch.hidden_size, arch.vocab_size, bias=False)
            )
        cos_sin = rope_table(arch, device)
        self.register_buffer("cos_sin", cos_sin, persistent=False)  # [P, D]
        local = arch.rope_local_theta
        if local is not None and local != arch.rope_theta and arch.windowed:
            local_cos_sin = rotary_cos_sin(
                arch.head_dim, arch.max_position_embeddings, local, device
            )
        else:
            local_cos_sin = cos_sin
        self.register_buffer("cos_sin_local", local_cos_sin, persistent=False)
        self.attention_backend: AttentionBackend = (
            backend if backend is not None else torch_backend()
        )
        self.kv_caches: KVCaches | None = None
        self.lm_head_quantized: BlockWeight | None = None
        """The output projection in GGUF blocks (native kernel), when the loader set it."""
        self.native_layers = True
        """On the `cpu` backend with quantized matmuls, run the decoder stack as one native call
        for steps whose attention is all native rows (bit-identical; False: layer by layer)."""
        self._stack: NativeLayerStack | str | None = None
        """The native stack once built, or why it cannot be (None: not tried yet)."""
        self._prefix_stacks: dict[int, NativeLayerStack] = {}
        """Stacks of the first layers only, by their number (self-speculation's drafts)."""

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Replace the kernel backend (chosen once at start-up, before serving)."""
        self.attention_backend = backend
        self._stack = None
        self._prefix_stacks = {}

    def bind_kv_caches(self, kv_caches: KVCaches) -> None:
        """Attach one (k_cache, v_cache) per layer (see `kv_layout.allocate_kv_caches`)."""
        check_kv_caches(self.arch, kv_caches)
        self.kv_caches = kv_caches
        self._stack = None
        self._prefix_stacks = {}

    def native_stack(self, num_layers: int | None = None) -> NativeLayerStack | None:
        """The decoder stack (or its first `num_layers` layers) as one native call, where this
        model and its caches qualify."""
        if self._stack is None:
            try:
                self._stack = self._build_stack()
            except ValueError as exc:
                self._stack = str(exc)
        if not isinstance(self._stack, NativeLayerStack):
            return None
        if num_layers is None or num_layers == len(self.layers):
            return self._stack
        if num_layers not in self._prefix_stacks:
            self._prefix_stacks[num_layers] = self._build_stack(num_layers)
        return self._prefix_stacks[num_layers]

    def _build_stack(self, num_layers: int | None = None) -> NativeLayerStack:
        a = self.arch
        if self.attention_backend.name != "cpu" or self.kv_caches is None:
            raise ValueError("needs the cpu attention backend and bound caches")
        if a.qkv_bias:
            raise ValueError("qkv biases are not in the native stack")
        layers = []
        pairs = list(zip(self.layers, self.kv_caches, strict=True))[:num_layers]
        for i, (layer, kv_cache) in enumerate(pairs):
            assert isinstance(layer, DecoderLayer)
            cos_sin = self.cos_sin_local if a.window(i) else self.cos_sin
            layers.append(layer.native_weights(kv_cache, cos_sin))
        shape = StackShape(
            a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size,
            a.rms_norm_eps, a.attention_scale,
        )  # fmt: skip
        return NativeLayerStack(layers, shape)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [B_sample, V] float32
        return self.compute_logits(self.forward_hidden(batch))

    @torch.inference_mode()
    def forward_hidden(
        self, batch: ForwardBatch, num_layers: int | None = None
    ) -> torch.Tensor:  # [B_sample, hidden]
        """Final-normed hidden states of the `logits_indices` rows; with `num_layers`, of the
        first layers only (self-speculation's draft: they write their layers' KV alone)."""
        if self.kv_caches is None:
            raise RuntimeError("call bind_kv_caches() before running the model")
        step = self.step_context(batch)
        plan, window_plan = step.plan, step.window_plan
        h = self.embed(batch.input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        stack = self.native_stack(num_layers) if self.native_layers else None
        if stack is not None and plan is not None and step_applies(plan, h.shape[0], window_plan):
            h, residual = stack.run(
                h, batch.positions, batch.slot_mapping, plan, batch.window_slot_mapping, window_plan
            )
        else:
            layers = list(zip(self.layers, self.kv_caches, strict=True))[:num_layers]
            for layer, kv_cache in layers:
                h, residual = layer(h, residual, kv_cache, step)
        assert residual is not None
        return self.final_hidden(h, residual, batch)

    def step_context(self, batch: ForwardBatch) -> StepContext:
        """What every layer of `batch`'s forward shares (its attention plans, the RoPE tables)."""
        assert self.kv_caches is not None
        return step_context(
            batch, self.attention_backend, self.arch, self.kv_caches, self.cos_sin,
            self.cos_sin_local,
        )  # fmt: skip

    def final_hidden(
        self, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:  # [T, hidden] x 2 -> [B_sample, hidden]
        """The last layer's output added to the residual stream and normed, for the
        `logits_indices` rows."""
        h, residual = h[batch.logits_indices], residual[batch.logits_indices]  # [B_sample, hidden]
        if h.shape[0] == 0:  # nothing to sample this step (prefill chunks only)
            return h
        h, _ = self.attention_backend.fused_add_rms_norm(
            h, residual, self.norm.weight, self.arch.rms_norm_eps
        )
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B_sample, V] float32
        if self.lm_head_quantized is not None:
            return block_linear(hidden, self.lm_head_quantized).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Left transposed ([V, B] storage): a greedy argmax reads it as fast, and a copy of
        # B x 49k floats is not free; the sampler makes its own contiguous copy when it draws.
        return cpu_aware_linear(hidden, weight, contiguous=False).float()  # [B_sample, V]
