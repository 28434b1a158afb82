"""Mixture-of-Experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama-family decoder whose
sparse layers replace the FFN with a router and experts (`ModelArch.moe`); attention, norms,
embeddings and the paged caches are the Llama model's.

Expert weights are stacked per layer, `w_gate_up` [E, 2I, D] (rows [gate; up], as the dense
`gate_up_proj`) and `w_down` [E, D, I]; a step multiplies each expert's tokens once
(`kernels/moe/moe_torch.combine_pairs`; on the triton backend every expert's rows in one launch,
`kernels/moe/moe_grouped.py`; a GGUF file's quantized experts in their blocks on CPU, all of them in
one native call on the cpu backend, `kernels/moe/moe_cpu.py`).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from deepinfer.kernels.layers.llama_layers_cpu import LayerWeights
from deepinfer.kernels.linear.int8_matmul import BlockWeight, FixedOrderWeight, block_linear
from deepinfer.kernels.moe.moe_cpu import NativeExperts
from deepinfer.kernels.moe.moe_torch import (
    ExpertFFN,
    RunExperts,
    combine_pairs,
    expert_counts,
    float_experts,
    route,
    run_each,
    runs_of,
)
from deepinfer.kernels.native.cpu_native import NativeUnavailableError
from deepinfer.model.arch import ModelArch, MoEArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.experts.parallel import ExpertParallel
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.llama_layers import Linear, LlamaDecoderLayer, LlamaMLP
from deepinfer.model.mla import MLAAttention
from deepinfer.model.tensor_parallel import RowCutSum


class SharedExpert(LlamaMLP):
    """Qwen2-MoE's expert every token passes through, scaled by sigmoid(gate(h)) when gated."""

    def __init__(self, arch: ModelArch, moe: MoEArch) -> None:
        nn.Module.__init__(self)
        self.gate_up_proj = Linear(arch.hidden_size, 2 * moe.shared_intermediate_size, bias=False)
        self.down_proj = Linear(moe.shared_intermediate_size, arch.hidden_size, bias=False)
        self.gate = Linear(arch.hidden_size, 1, bias=False) if moe.shared_gate else None

    def forward(self, h: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:
        out = super().forward(h, ops)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(h))
        return out


class ExpertLoad:
    """Tokens routed to each expert of one layer since start (a token counts once per expert it
    is routed to); added to by whichever worker thread runs the layer, read by the stats."""

    def __init__(self, num_experts: int) -> None:
        self._counts = torch.zeros(num_experts, dtype=torch.int64, device="cpu")
        self._lock = threading.Lock()

    def add(self, counts: list[int]) -> None:
        step = torch.tensor(counts, dtype=torch.int64)
        with self._lock:
            self._counts += step

    def totals(self) -> list[int]:
        with self._lock:
            totals: list[int] = self._counts.tolist()
        return totals


class MoEBlock(nn.Module):
    quantized: tuple[list[BlockWeight], list[BlockWeight]] | None = None
    """Each expert's gate_up and down in blocks (native kernel), once `quantize` set them."""
    native: NativeExperts | None = None
    """Those blocks as the one-call native kernel reads them (where it takes them)."""
    parallel: ExpertParallel | None = None
    """The expert-parallel groups that compute this layer's rows (None: all here)."""
    experts_here: tuple[int, int] | None = None
    """Tensor parallel: [first, end) of the experts this rank computes; the others' rows add
    nothing here, and the layer's output is summed over the ranks (`reduce`)."""
    reduce: RowCutSum | None = None

    def __init__(self, arch: ModelArch, moe: MoEArch, layer: int) -> None:
        super().__init__()
        self.moe = moe
        self.layer = layer
        d, i, e = arch.hidden_size, moe.expert_intermediate_size, moe.num_experts
        self.router = Linear(d, e, bias=False)
        self.router_bias = (
            nn.Parameter(torch.empty(e), requires_grad=False) if moe.score_bias else None
        )
        """Added to the scores that choose experts, never to the gates (`MoEArch.score_bias`)."""
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, d), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        self.shared = SharedExpert(arch, moe) if moe.shared_intermediate_size else None
        self.load = ExpertLoad(e)

    def quantize(self, gate_up: list[BlockWeight], down: list[BlockWeight]) -> None:
        """Serve expert e from `gate_up[e]` and `down[e]` (the same values as its rows of
        `w_gate_up` and `w_down`, in blocks) and drop the fp32 stacks."""
        e, two_i, d = self.w_gate_up.shape
        fits = len(gate_up) == len(down) == e and all(
            (g.out_features, g.in_features, w.out_features, w.in_features)
            == (two_i, d, d, two_i // 2)
            for g, w in zip(gate_up, down, strict=True)
        )
        if not fits:
            raise ValueError(f"expert weights of other shapes than {tuple(self.w_gate_up.shape)}")
        self.quantized = (gate_up, down)
        self.w_gate_up = self.w_down = None  # type: ignore[assignment]
        try:
            self.native = NativeExperts(gate_up, down)
        except (ValueError, NativeUnavailableError):
            self.native = None  # the fixed-order Triton matmul's, or no native kernels here

    def expert_ffn(self, ops: AttentionBackend) -> ExpertFFN:
        if self.quantized is None:
            return float_experts(self.w_gate_up, self.w_down, ops.silu_mul)
        gate_up, down = self.quantized

        def ffn(expert: int, x: torch.Tensor) -> torch.Tensor:
            return block_linear(ops.silu_mul(block_linear(x, gate_up[expert])), down[expert])

        return ffn

    def expert_runner(self, ops: AttentionBackend) -> RunExperts:
        """Runs of rows through their experts: one native call for all on the `cpu` backend
        (bit-identical), else one `expert_ffn` call per run."""
        if self.native is not None and ops.name == "cpu":
            return self.native.run
        return run_each(self.expert_ffn(ops))

    def forward(self, h: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:  # [T, D]
        m = self.moe
        gates, experts = route(
            self.router(h), m.top_k, m.routing, m.renormalize, m.routed_scaling,
            self.router_bias, m.num_groups, m.topk_groups,
        )  # fmt: skip  # [T, k] each
        counts = expert_counts(experts, m.num_experts)
        self.load.add(counts)
        if self.experts_here is not None:
            runner, here = self.expert_runner(ops), self.experts_here
            out = combine_pairs(
                h, experts, gates, lambda rows: rows_here(runner, rows, counts, here)
            )
        elif self.parallel is not None:
            parallel, layer = self.parallel, self.layer
            out = combine_pairs(h, experts, gates, lambda rows: parallel.run(layer, rows, counts))
        elif ops.name == "triton" and self.quantized is None:  # one launch for every expert
            from deepinfer.kernels.moe.moe_grouped import triton_grouped_experts

            out = triton_grouped_experts(
                h, experts, gates, self.w_gate_up, self.w_down, ops.silu_mul
            )
        else:
            runner, runs = self.expert_runner(ops), runs_of(counts)
            out = combine_pairs(h, experts, gates, lambda rows: runner(rows, runs))
        if self.shared is not None:  # (under tensor parallel: this rank's features of it)
            out = out + self.shared(h, ops)
        if self.reduce is not None:
            partial = out
            out = self.reduce(
                lambda before: partial if before is None else before + partial,
                (h.shape[0], h.shape[1]),
                h.dtype,
            )
        return out


def rows_here(
    runner: RunExperts, rows: torch.Tensor, counts: list[int], here: tuple[int, int]
) -> torch.Tensor:
    """A step's rows sorted by expert, computed where their expert is in [first, end) (one
    contiguous run of rows), zero elsewhere: a tensor-parallel rank's share."""
    first, end = here
    start, n = sum(counts[:first]), sum(counts[first:end])
    out = torch.zeros_like(rows)
    if n:
        runs = [(e, c) for e, c in runs_of(counts) if first <= e < end]
        out[start : start + n] = runner(rows[start : start + n], runs)
    return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama-family layer whose FFN is a `MoEBlock` where the layer is sparse."""

    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__(arch, layer)
        if arch.mla is not None:
            self.self_attn = MLAAttention(arch, layer)  # type: ignore[assignment]
        if arch.moe is not None and arch.sparse(layer):
            self.mlp = MoEBlock(arch, arch.moe, layer)  # type: ignore[assignment]

    def native_weights(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor
    ) -> LayerWeights:
        if isinstance(self.mlp, MoEBlock) or isinstance(self.self_attn, MLAAttention):
            raise ValueError("the native stack has no expert or latent-attention layers")
        return super().native_weights(kv_cache, cos_sin)


class MoEForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM`'s interface and paged caches, with expert layers (layer by layer: the
    native one-call stack has no experts)."""

    decoder_layer = MoEDecoderLayer
    expert_parallel: ExpertParallel | None = None

    def blocks(self) -> dict[int, MoEBlock]:
        """The sparse layers' expert blocks, by layer."""
        return {
            i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)
        }

    def set_expert_parallel(self, parallel: ExpertParallel | None) -> None:
        """Have `parallel`'s groups compute every sparse layer's experts (None: all here)."""
        self.expert_parallel = parallel
        for block in self.blocks().values():
            block.parallel = parallel

    def layer_runners(self) -> dict[int, RunExperts]:
        """Each sparse layer's experts on this model's weights and kernels."""
        ops = self.attention_backend
        return {layer: block.expert_runner(ops) for layer, block in self.blocks().items()}

    def expert_weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's float (gate_up [2I, D], down [D, I]) (experts in GGUF blocks are
        served on CPU only, where groups read them in place)."""
        block = self.blocks()[layer]
        if block.quantized is None:
            return block.w_gate_up[expert], block.w_down[expert]
        gate_up, down = block.quantized[0][expert], block.quantized[1][expert]
        if not isinstance(gate_up, FixedOrderWeight) or not isinstance(down, FixedOrderWeight):
            raise ValueError("experts in GGUF blocks stay on the CPU")
        return gate_up.weight, down.weight

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, num_layers: int | None = None) -> torch.Tensor:
        h = super().forward_hidden(batch, num_layers)
        if self.expert_parallel is not None:
            self.expert_parallel.end_step()
        return h

    def expert_load(self) -> list[list[int]]:
        """Per layer, tokens routed to each expert since start (empty for a dense layer)."""
        return [
            layer.mlp.load.totals() if isinstance(layer.mlp, MoEBlock) else []
            for layer in self.layers
        ]
