"""The Llama-family decoder (Llama, Qwen2 with QKV bias, Qwen3 with per-head q/k RMSNorm; any
layer may attend a sliding window, with a RoPE base of its own).

Parameters are fused for fewer, larger matmuls: `qkv_proj` rows are [q; k; v] and `gate_up_proj`
rows are [gate; up], in Hugging Face's (rotate-half RoPE) layout. The model is built on the meta
device and receives its weights through `load_state_dict(..., assign=True)`.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.elementwise.rotary_torch import rotary_cos_sin
from deepinfer.kernels.layers.llama_layers_cpu import NativeLayerStack, StackShape, step_applies
from deepinfer.kernels.linear.int8_matmul import BlockWeight, block_linear
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend, torch_backend
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches, check_kv_caches

# Re-exported for callers that import the KV helpers next to the model.
from deepinfer.model.kv_layout import allocate_kv_caches as allocate_kv_caches
from deepinfer.model.kv_layout import kv_bytes_per_block as kv_bytes_per_block
from deepinfer.model.llama_layers import (
    DecoderLayer,
    Embedding,
    Linear,
    LlamaDecoderLayer,
    RMSNorm,
    cpu_aware_linear,
)
from deepinfer.model.rope import rope_table
from deepinfer.model.step_context import StepContext, step_context
from deepinfer.model.tensor_parallel import StepLeader


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
            self.embed_tokens: nn.Module = Embedding(arch.vocab_size, arch.hidden_size)
            """The token table (`QuantizedEmbedding` once served from GGUF blocks)."""
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
        self.step_leader: StepLeader | None = None
        """Tensor parallel, on rank 0: sends each forward's batch to the other ranks, which
        run the same forward on their shards (None: this model is whole, or a follower)."""

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
        if self.step_leader is not None:
            with self.step_leader.step(batch, num_layers):
                return self._forward_hidden(batch, num_layers)
        return self._forward_hidden(batch, num_layers)

    def _forward_hidden(self, batch: ForwardBatch, num_layers: int | None) -> torch.Tensor:
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
        weight = (self.embed_tokens if self.lm_head is None else self.lm_head).weight
        assert isinstance(weight, torch.Tensor), "a head in blocks is `lm_head_quantized`"
        # Left transposed ([V, B] storage): a greedy argmax reads it as fast, and a copy of
        # B x 49k floats is not free; the sampler makes its own contiguous copy when it draws.
        return cpu_aware_linear(hidden, weight, contiguous=False).float()  # [B_sample, V]
