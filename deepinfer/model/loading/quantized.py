"""Serve a GGUF model's block-quantized matrices as they are stored (CPU, native kernel).

Before the model's weights are loaded (its modules still on the meta device), `quantize_linears`
gives each linear layer whose source tensors are all in one format the kernel takes (Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K; Q4_0 repacked as Q4_1, Q5_0 as Q8_0) its blocks, and the tied or separate LM
head and the token embedding too; the loader then dequantizes only the tensors left (norms, and
matrices in other formats), so no fp32 copy of a served matrix is ever made (a 7B model's would
be 28 GB). The float kernel multiplies by the same fp32
values (dequantized on the fly), reading 4-7x fewer bytes per step; only the order of each dot
product's sum differs from BLAS. With int8 activations the blocks are repacked for the integer
kernel instead (deepinfer.kernels.linear.int8_matmul). `quantized_matmul_wanted` and
`int8_activations_wanted` decide, per the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from deepinfer.errors import ModelLoadError
from deepinfer.kernels.linear.bf16_probe import Bf16Probe, Bf16Verdict
from deepinfer.kernels.linear.bf16_tiles import MIN_ROWS
from deepinfer.kernels.linear.fixed_sum import FixedSumWeight
from deepinfer.kernels.linear.int8_matmul import (
    BlockWeight,
    FixedOrderWeight,
    Int8PackedWeight,
    NativeWeight,
    fusion_problem,
    pack_int8_rows,
)
from deepinfer.kernels.linear.quant_matmul import QuantizedWeight
from deepinfer.kernels.native.cpu_native import NativeUnavailableError, native_library
from deepinfer.model.experts.moe import MoEBlock
from deepinfer.model.llama_layers import Linear, QuantizedEmbedding
from deepinfer.model.loading.gguf_loader import KERNEL_FORMAT_NAMES, GGUFTensorSource
from deepinfer.model.loading.sharding import ShardedSource
from deepinfer.model.loading.weights import deinterleave_rows, linear_sources, shared_expert_sources
from deepinfer.model.mla import MLAAttention

log = logging.getLogger(__name__)

QuantizedSource = GGUFTensorSource | ShardedSource
"""A GGUF file's tensors, whole or one tensor-parallel rank's cut of them."""


def quantized_matmul_wanted(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to serve quantized matrices: `auto` when the native kernel runs here, `on`
    (an error if it cannot), `off`. Only for float32 serving on CPU."""
    if mode == "off":
        return False
    reason = None
    if device.type != "cpu" or dtype != torch.float32:
        reason = f"it serves float32 on CPU (here {dtype} on {device.type})"
    else:
        try:
            native_library()
        except NativeUnavailableError as exc:
            reason = str(exc)
    if reason is None:
        return True
    if mode == "on":
        raise ModelLoadError(f"--quantized-matmul on, but the native kernel cannot run: {reason}")
    log.info("quantized matmul off: %s", reason)
    return False


def int8_activations_wanted(mode: str, quantized: bool) -> bool:
    """Whether the quantized kernel takes int8 activations: `auto` where it serves the model
    (GGUF matrices in a kernel format, on CPU), `int8` (an error without that kernel), `float32`
    never."""
    if mode not in ("auto", "float32", "int8"):
        raise ModelLoadError(f"unknown matmul activations {mode!r}: choose auto, float32 or int8")
    if mode == "auto":
        return quantized
    if mode == "int8" and not quantized:
        raise ModelLoadError(
            "--matmul-activations int8 needs the quantized matmul (a GGUF file with "
            f"{'/'.join(KERNEL_FORMAT_NAMES)} matrices, float32 on CPU, the native kernels)"
        )
    return mode == "int8"


@dataclass(frozen=True)
class Served:
    """What `quantize_linears` serves from blocks."""

    nbytes: int
    """Bytes of the blocks the kernel multiplies by."""
    sources: frozenset[str]
    """The checkpoint tensors (canonical names) served: the loader does not dequantize them."""


def quantize_linears(
    model: nn.Module, source: QuantizedSource, num_layers: int, int8: bool = False
) -> Served:
    """Give every linear layer stored in a kernel format its blocks (repacked for the int8
    kernel when `int8`), the LM head and the token embedding too: the modules may still be on
    the meta device (their shapes are checked, their fp32 weights dropped)."""
    modules = dict(model.named_modules())
    total = 0
    served: set[str] = set()
    others = source.other_formats()
    if others:
        listed = ", ".join(f"{n} in {kind}" for kind, n in sorted(others.items()))
        log.info(
            "matrices dequantized to float32 (the quantized matmul takes %s): %s",
            ", ".join(KERNEL_FORMAT_NAMES),
            listed,
        )
    for i in range(num_layers):
        total += _quantize_modules(linear_sources(i), source, int8, modules, served)
        attn = modules.get(f"layers.{i}.self_attn")
        if isinstance(attn, MLAAttention):
            total += _quantize_mla(attn, source, i, int8, served)
        block = modules.get(f"layers.{i}.mlp")
        if isinstance(block, MoEBlock):
            total += _quantize_modules(shared_expert_sources(i), source, int8, modules, served)
            total += _quantize_experts(block, source, i, int8, served)
    tied = getattr(model, "lm_head", None) is None
    embedding = source.load_quantized("embed_tokens.weight")
    blocks = embedding if tied else source.load_quantized("lm_head.weight", copy=not int8)
    if blocks is not None:
        head = _served(blocks, int8)
        setattr(model, "lm_head_quantized", head)  # noqa: B010 (any model with the attribute)
        if not tied:  # a separate head: no fp32 copy
            setattr(model, "lm_head", None)  # noqa: B010
            served.add("lm_head.weight")
        total += head.nbytes
    if embedding is not None and isinstance(model.get_submodule("embed_tokens"), nn.Embedding):
        # looked up from its blocks (a tied head not repacked shares them), not a fp32 table
        setattr(model, "embed_tokens", QuantizedEmbedding(embedding))  # noqa: B010
        served.add("embed_tokens.weight")
    return Served(total, frozenset(served))


def serve_fixed_order(model: nn.Module) -> None:
    """Serve every linear layer and the LM head that no block kernel serves through the
    fixed-order Triton matmul (`FixedOrderWeight`; the batch-invariant mode on the Triton
    backend). The weights are the model's own tensors (a tied head shares the embedding's)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None:
            module.quantize(FixedOrderWeight(module.weight.detach()))
        elif isinstance(module, MoEBlock) and module.quantized is None:
            module.quantize(
                [FixedOrderWeight(w) for w in module.w_gate_up.detach()],
                [FixedOrderWeight(w) for w in module.w_down.detach()],
            )
    if getattr(model, "lm_head_quantized", None) is None:
        head = getattr(model, "lm_head", None)
        source = head.quantized if isinstance(head, Linear) else None
        if source is None:
            embed = model.get_submodule("embed_tokens")
            assert isinstance(embed, nn.Embedding), "a tied head is the token embedding"
            source = FixedOrderWeight(embed.weight.detach())
        setattr(model, "lm_head_quantized", source)  # noqa: B010 (any model with the attribute)


def serve_routers_fixed_sum(model: nn.Module) -> None:
    """The batch-invariant mode on CPU: a Mixture of Experts' routers (and shared-expert gates),
    which GGUF files keep in float32, through the fixed-sum matmul (`FixedSumWeight`): small
    matrices, whose every output is one sum in one order whatever the step."""
    for block in model.modules():
        if isinstance(block, MoEBlock):
            gate = block.shared.gate if block.shared is not None else None
            for linear in (block.router, gate):
                if linear is not None and linear.quantized is None:
                    linear.quantize(FixedSumWeight(linear.weight.detach()))


def float_matrices(model: nn.Module) -> list[str]:
    """The matrices the quantized kernel does not serve (BLAS multiplies them, in an order that
    depends on how many rows a step has): linear layers, and the LM head."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.quantized is None and module.weight.numel()
    ]  # (an empty one, a tensor-parallel rank's without heads, sums nothing)
    names += [
        f"{name}.experts"
        for name, module in model.named_modules()
        if isinstance(module, MoEBlock) and module.quantized is None
    ]
    if getattr(model, "lm_head_quantized", None) is None:
        names.append("lm_head")
    return names


def _quantize_modules(
    sources: dict[str, tuple[str, ...]],
    source: QuantizedSource,
    int8: bool,
    modules: dict[str, nn.Module],
    served: set[str],
) -> int:
    """The linear modules of `sources` whose tensors are in a kernel format, in blocks; the
    bytes served (their tensors added to `served`)."""
    total = 0
    for name, parts in sources.items():
        module = modules.get(name)
        fused = _fused(source, parts, int8) if isinstance(module, Linear) else None
        if fused is not None:
            assert isinstance(module, Linear)
            weight = _served(fused, int8)
            module.quantize(weight)
            served.update(parts)
            total += weight.nbytes
    return total


def _quantize_mla(
    attn: MLAAttention, source: QuantizedSource, layer: int, int8: bool, served: set[str]
) -> int:
    """A latent-attention layer's projections stored in a kernel format, in blocks (the rotary
    rows reordered as `weights._mla_state` reorders the float ones: whole rows of blocks
    move); the bytes served."""
    m, theirs = attn.mla, f"layers.{layer}.self_attn."
    q = "q_b_proj" if m.q_lora_rank else "q_proj"
    rotary = {q: (attn.arch.head_dim, m.qk_nope_head_dim), "kv_a_proj": (
        m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank)}  # fmt: skip
    stored = {q: q, "kv_a_proj": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj"}
    if m.q_lora_rank:
        stored["q_a_proj"] = "q_a_proj"
    total = 0
    for ours, name in stored.items():
        blocks = source.load_quantized(theirs + name + ".weight")
        if blocks is None:
            continue
        if ours in rotary and m.interleaved_rope:
            width, start = rotary[ours]
            rows = deinterleave_rows(blocks.blocks, width, start, m.qk_rope_head_dim)
            blocks = QuantizedWeight(blocks.fmt, rows.contiguous(), blocks.in_features)
        weight = _served(blocks, int8)
        linear = getattr(attn, ours)
        assert isinstance(linear, Linear)
        linear.quantize(weight)
        served.add(theirs + name + ".weight")
        total += weight.nbytes
    return total


def _quantize_experts(
    block: MoEBlock, source: QuantizedSource, layer: int, int8: bool, served: set[str]
) -> int:
    """A sparse layer's experts in blocks, where every one is stored in a kernel format (else
    none); the bytes served."""
    total = 0
    gate_up: list[BlockWeight] = []
    down: list[BlockWeight] = []
    names: list[str] = []
    for j in range(block.moe.num_experts):
        e = f"layers.{layer}.mlp.experts.{j}."
        names += [e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"]
        gu = _fused(source, (e + "gate_proj.weight", e + "up_proj.weight"), int8)
        dn = _fused(source, (e + "down_proj.weight",), int8)
        if gu is None or dn is None:
            return total
        pair = _served(gu, int8), _served(dn, int8)
        gate_up.append(pair[0])
        down.append(pair[1])
        total += pair[0].nbytes + pair[1].nbytes
    block.quantize(gate_up, down)
    served.update(names)
    return total


def _served(weight: QuantizedWeight | list[QuantizedWeight], int8: bool) -> NativeWeight:
    """The kernel's weight: a fused projection's parts repacked end to end for the int8 kernel
    (read from the file's mapping, never copied), else their blocks in one tensor."""
    parts = weight if isinstance(weight, list) else [weight]
    if int8:
        return pack_int8_rows(parts)
    return QuantizedWeight.cat(parts) if len(parts) > 1 else parts[0]


def _fused(
    source: QuantizedSource, names: tuple[str, ...], int8: bool
) -> list[QuantizedWeight] | None:
    """The parts of a fused projection, if all are in one kernel format and width (or, for the
    int8 kernel, in two runs of formats: `pack_int8_rows`): views of the file's mapping when the
    int8 kernel repacks them (nothing keeps them), else copies."""
    parts = [source.load_quantized(n, copy=not int8) for n in names]
    if any(p is None for p in parts):
        return None
    ready = [p for p in parts if p is not None]
    if int8:
        return ready if fusion_problem(ready) is None else None
    return ready if len({(p.fmt, p.in_features) for p in ready}) == 1 else None


def probe_verdict(probe: Bf16Probe) -> Bf16Verdict:
    """The probe's answer, logged."""
    verdict = probe.result()
    log.info(
        "bf16 prefill: attention %s, tiles %s: %s",
        "on" if verdict.attention else "off",
        ", ".join(sorted(verdict.tiles)) or "off",
        verdict.said,
    )
    return verdict


def serve_long_rows_bf16(model: nn.Module, formats: frozenset[str] | None = None) -> int:
    """Let every int8-served matrix (the LM head's too) whose block formats are all in
    `formats` (None: any) take products of `MIN_ROWS` rows or more as bf16 tiles; the number
    of matrices."""

    def serves(w: Int8PackedWeight) -> bool:
        return formats is None or {w.fmt.name, w.second[0].name} <= formats

    count = 0
    for module in model.modules():
        weight = module.quantized if isinstance(module, Linear) else None
        if isinstance(weight, Int8PackedWeight) and serves(weight):
            module.quantized = replace(weight, bf16_rows=MIN_ROWS)
            count += 1
    head = getattr(model, "lm_head_quantized", None)
    if isinstance(head, Int8PackedWeight) and serves(head):
        setattr(model, "lm_head_quantized", replace(head, bf16_rows=MIN_ROWS))  # noqa: B010
        count += 1
    return count
