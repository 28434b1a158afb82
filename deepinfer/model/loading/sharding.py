"""Tensor-parallel shards of a Llama-family model (Megatron's split): rank r of N holds a run
of the KV heads with their query heads (the q/k/v rows and the o_proj columns of those heads)
and a run of the FFN's intermediate features (the gate/up rows and the down_proj columns of
those features); everything else (embeddings, norms, the LM head) is whole on every rank. The
o_proj and down_proj outputs are partial sums, added over the ranks (`runner/tensor_ranks.py`).
A Mixture of Experts' experts go over the same ranks, a `cut` of them each (every rank loads
them all and computes the rows of its own), its shared expert cut by features like the FFN.
With more ranks than KV heads (SmolLM2's 3 over 4 ranks) the last ranks hold no heads: their
attention is skipped and adds nothing, while every rank still takes its share of the FFN (a
KV head is never copied, so no rank stores another's keys and values).

`ShardedSource` cuts a checkpoint's tensors as they are read: float tensors by rows or columns,
GGUF matrices in their blocks (rows are whole rows of blocks; a column cut falls on block
boundaries: the FFN is cut in units of 256 features, the heads in whole heads), so a rank never
holds or repacks more than its shard.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from deepinfer.errors import ConfigError
from deepinfer.kernels.linear.quant_matmul import QuantizedWeight
from deepinfer.model.arch import ModelArch
from deepinfer.model.loading.weights import TensorSource

FFN_UNIT = 256
"""The FFN is cut in multiples of this many features (the K-quants' block) where that gives
every rank some, else of 32 (the other formats' block), else of one (a float model's)."""


@dataclass(frozen=True)
class TPShard:
    rank: int
    world: int
    kv_heads: tuple[int, int]
    """[first, end) of the KV heads this rank holds."""
    heads: tuple[int, int]
    """[first, end) of the query heads (the KV heads' groups)."""
    ffn: tuple[int, int]
    """[first, end) of the FFN's intermediate features."""
    shared: tuple[int, int] = (0, 0)
    """[first, end) of a Mixture of Experts' shared expert's features."""


def cut(total: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s run of `total // unit` units split as evenly as can be, in elements."""
    units = total // unit
    base, extra = divmod(units, world)
    first = rank * base + min(rank, extra)
    return first * unit, (first + base + (rank < extra)) * unit


def _features(size: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s run of an FFN's `size` features, in the largest unit that gives every rank
    some."""
    unit = next(u for u in (FFN_UNIT, 32, 1) if size % u == 0 and size // u >= world)
    return cut(size, world, rank, unit)


def shard_plan(arch: ModelArch, world: int, rank: int) -> TPShard:
    """Rank `rank`'s shard of `arch` over `world` ranks; ConfigError where it cannot be cut."""
    if arch.mla is not None:
        raise ConfigError("--tensor-parallel: grouped-query attention only (no MLA)")
    moe = arch.moe
    if moe is not None and moe.num_experts % world:
        raise ConfigError(
            f"--tensor-parallel {world}: {moe.num_experts} experts do not divide evenly "
            "over the ranks"
        )
    if world > min(arch.num_heads, arch.intermediate_size):
        raise ConfigError(
            f"--tensor-parallel {world}: the model has {arch.num_heads} attention heads, at most "
            "that many ranks"
        )
    group = arch.num_heads // arch.num_kv_heads
    kv = cut(arch.num_kv_heads, world, rank)  # past the KV heads, a rank holds none
    heads = (kv[0] * group, kv[1] * group)
    ffn = _features(arch.intermediate_size, world, rank)
    if moe is None:
        return TPShard(rank, world, kv, heads, ffn)
    shared = (
        _features(moe.shared_intermediate_size, world, rank)
        if moe.shared_intermediate_size
        else (0, 0)
    )
    return TPShard(rank, world, kv, heads, ffn, shared)


def local_arch(arch: ModelArch, shard: TPShard) -> ModelArch:
    """The shape one rank computes: its heads and FFN features (and its shared expert's)."""
    moe = arch.moe
    if moe is not None:
        moe = dataclasses.replace(moe, shared_intermediate_size=shard.shared[1] - shard.shared[0])
    return dataclasses.replace(
        arch,
        num_heads=shard.heads[1] - shard.heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.ffn[1] - shard.ffn[0],
        moe=moe,
        tensor_parallel_shard=True,
    )


_LAYER = re.compile(r"^layers\.\d+\.(.+)$")


class ShardedSource:
    """`source` with each layer's attention and FFN tensors cut to `shard`."""

    def __init__(self, source: TensorSource, arch: ModelArch, shard: TPShard) -> None:
        self._source = source
        d = arch.head_dim
        q = (shard.heads[0] * d, shard.heads[1] * d)
        kv = (shard.kv_heads[0] * d, shard.kv_heads[1] * d)
        self._rows = {
            "self_attn.q_proj.weight": q, "self_attn.q_proj.bias": q,
            "self_attn.k_proj.weight": kv, "self_attn.k_proj.bias": kv,
            "self_attn.v_proj.weight": kv, "self_attn.v_proj.bias": kv,
            "mlp.gate_proj.weight": shard.ffn, "mlp.up_proj.weight": shard.ffn,
        }  # fmt: skip
        self._columns = {"self_attn.o_proj.weight": q, "mlp.down_proj.weight": shard.ffn}
        if arch.moe is not None and arch.moe.shared_intermediate_size:
            shared = "mlp.shared_expert."
            self._rows |= {shared + "gate_proj.weight": shard.shared,
                           shared + "up_proj.weight": shard.shared}  # fmt: skip
            self._columns[shared + "down_proj.weight"] = shard.shared

    def names(self) -> set[str]:
        return self._source.names()

    def _cut_of(self, name: str) -> tuple[int, tuple[int, int]] | None:
        """(dim, [first, end)) of `name`'s cut, None when whole."""
        match = _LAYER.match(name)
        if match is None:
            return None
        tail = match.group(1)
        if tail in self._rows:
            return 0, self._rows[tail]
        if tail in self._columns:
            return 1, self._columns[tail]
        return None

    def load(self, name: str) -> torch.Tensor:
        tensor = self._source.load(name)
        cut = self._cut_of(name)
        if cut is None:
            return tensor
        dim, (first, end) = cut
        return tensor.narrow(dim, first, end - first).contiguous()

    def load_quantized(self, name: str, copy: bool = True) -> QuantizedWeight | None:
        load = getattr(self._source, "load_quantized", None)
        w = load(name, copy=copy) if load is not None else None
        cut = self._cut_of(name)
        if w is None or cut is None:
            return w
        dim, (first, end) = cut
        if first == end:
            return None  # none of it here: an empty float matrix
        if dim == 0:
            return QuantizedWeight(w.fmt, w.blocks[first:end].contiguous(), w.in_features)
        per = w.fmt.block_weights
        if first % per or end % per:
            return None  # not on block boundaries: served dequantized
        width = w.fmt.block_bytes
        blocks = w.blocks[:, first // per * width : end // per * width].contiguous()
        return QuantizedWeight(w.fmt, blocks, end - first)

    def other_formats(self) -> dict[str, int]:
        """The source's matrices the kernel does not take, by format (a GGUF file's)."""
        others = getattr(self._source, "other_formats", None)
        return others() if others is not None else {}
