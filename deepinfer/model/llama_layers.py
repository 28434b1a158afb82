"""The Llama-family decoder's modules: the matmul, embedding and norm modules every model builds
on, attention (q/k/v projections with RoPE, then paged attention over the KV cache), the gated
FFN, and the decoder layer as attention's input and output around paged attention (which
prefill CUDA graphs capture apart, `model/piecewise.py`). `model/llama.py` stacks them.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.layers.llama_layers_cpu import LayerWeights
from deepinfer.kernels.linear.int8_matmul import (
    BlockWeight,
    Int8PackedWeight,
    block_linear,
    int8_linear,
)
from deepinfer.kernels.linear.quant_matmul import QuantizedWeight, dequantize
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.step_context import StepContext
from deepinfer.model.tensor_parallel import RowCutSum

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
    reduce: RowCutSum | None = None
    """Tensor parallel: sums a row-cut shard's products over the ranks (None: whole)."""

    def reset_parameters(self) -> None:
        if self.weight.numel():  # (a tensor-parallel rank without heads: nothing to fill)
            super().reset_parameters()

    def quantize(self, weight: BlockWeight) -> None:
        """Serve from `weight` (the same values as `self.weight`, in blocks) and drop the fp32
        copy."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.out_features}x{weight.in_features} weight for {self}")
        self.quantized = weight
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None and self.reduce is None:
            return cpu_aware_linear(x, self.weight, self.bias)
        if self.reduce is not None:  # a row-cut shard: its bias (if any) added once, after
            out = self.reduce(partial(self._product, x), (x.shape[0], self.out_features), x.dtype)
        else:
            assert self.quantized is not None
            out = block_linear(x, self.quantized)
        return out if self.bias is None else out + self.bias

    def _product(self, x: torch.Tensor, going_on: torch.Tensor | None) -> torch.Tensor:
        """A row-cut shard's x @ W^T, from zero or going on from `going_on` (the sums of the
        ranks before): the int8 kernel continues them block after block, which gives one
        rank's bits; any other product is added to them."""
        if self.in_features == 0:  # a rank holding none of the input features (no heads)
            return going_on if going_on is not None else x.new_zeros(x.shape[0], self.out_features)
        w = self.quantized
        if going_on is None:
            return block_linear(x, w) if w is not None else cpu_aware_linear(x, self.weight)
        if isinstance(w, Int8PackedWeight) and not (w.bf16_rows and x.shape[0] >= w.bf16_rows):
            return int8_linear(x, w, going_on)
        return going_on + self._product(x, None)


class Embedding(nn.Embedding):
    """`nn.Embedding` without the random init: its weight always comes from the checkpoint, and
    `normal_` on the meta device runs through torch's Python references, whose first call imports
    `torch._dynamo` (and with it Triton, where installed) even on the CPU path."""

    def reset_parameters(self) -> None:
        pass


class QuantizedEmbedding(nn.Module):
    """The token embedding served from its GGUF blocks: a lookup gathers the ids' rows of blocks
    and dequantizes those alone, giving the same fp32 rows as the dequantized table (the whole
    table in fp32 is 4-8x the blocks: 108 MiB for SmolLM2's 49k x 576, 890 MiB for Qwen2.5's
    152k x 1536). A tied LM head shares the blocks."""

    def __init__(self, blocks: QuantizedWeight) -> None:
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.out_features, blocks.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
        b = self.blocks
        rows = b.blocks.index_select(0, input_ids.reshape(-1))  # [T, row bytes], contiguous
        out = dequantize(QuantizedWeight(b.fmt, rows, b.in_features))
        return out.view(*input_ids.shape, b.in_features)


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
    input_norm: RMSNorm
    eps: float

    def attention_input(
        self, h: torch.Tensor, residual: torch.Tensor | None, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, the residual stream including the last layer's output): the input norm
        (added to the residual stream), then attention's projections."""
        ops = step.ops
        h, residual = self.add_and_norm_input(ops, h, residual, self.input_norm.weight, self.eps)
        return (*self.self_attn.project(h, step), residual)

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
        attn = self.self_attn
        if not attn.arch.num_heads:  # a tensor-parallel rank past the KV heads: attention's
            # share is nothing (its o_proj still joins the ranks' sum)
            _, residual = self.add_and_norm_input(step.ops, h, residual, self.input_norm.weight,
                                                  self.eps)  # fmt: skip
            nothing = h.new_empty(h.shape[0], 0, attn.arch.head_dim)
            return self.attention_output(nothing, residual, step)
        q, k, v, residual = self.attention_input(h, residual, step)
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
    (a Qwen3 or Gemma 3 layer's q/k norms, a Qwen2 layer's q/k/v bias included)."""
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.bias is not None for lin in linears[1:]):
        raise ValueError("the native stack has no biases but the q/k/v projection's")
    qkv_bias = attn.qkv_proj.bias
    qkv, o, gate_up, down = (lin.quantized for lin in linears)
    if qkv is None or o is None or gate_up is None or down is None:
        raise ValueError("every matmul must be served by a quantized kernel")
    q_norm = k_norm = None
    if attn.arch.qk_norm:
        q_norm, k_norm = attn.q_norm.weight.data, attn.k_norm.weight.data
    return LayerWeights(
        qkv, o, gate_up, down, input_norm.weight.data, post_norm.weight.data, *kv_cache,
        cos_sin=cos_sin, window=attn.window or 0, q_norm=q_norm, k_norm=k_norm,
        qkv_bias=None if qkv_bias is None else qkv_bias.data,
    )  # fmt: skip
