"""The native quantized matmuls alone: GFLOP/s of one layer's four projections at M rows.

By default random Q4_1 blocks of SmolLM2's shapes (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536); with `--model FILE.gguf`, one layer's projections as the loader serves them
(Gemma 3 270M Q4_K_M: q/k/v and gate/up Q5_0 served as Q8_0, o Q4_K, down Q6_K or Q4_K), with
torch's fp32 matmul on the same weights beside them. One layer's weights (2-4 MB) stay in
cache, so this is the kernels' arithmetic rate, not the weight stream's. The kernels run in the
same process, alternating: `float` (tiles dequantized to fp32, exact weights), `int8`
(activations quantized, integer dot products) and, for a model, `torch fp32`. Run from the
repository root:

    python -m bench.quant_gemm --rows 1 8 32 96
    python -m bench.quant_gemm --model ~/.cache/deepinfer/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf --layer 0
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.kernels.linear.int8_matmul import int8_linear, pack_int8
from deepinfer.kernels.linear.quant_matmul import (
    QK,
    QuantFormat,
    QuantizedWeight,
    dequantize,
    quant_linear,
)
from deepinfer.model.loading.gguf_loader import GGUFTensorSource, gguf_arch, open_gguf
from deepinfer.model.loading.weights import linear_sources

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    nb = k // QK
    blocks = torch.randint(0, 256, (n, nb * 20), dtype=torch.uint8, generator=gen)
    scales = blocks.view(n, nb, 20)
    scales[:, :, 0:4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)  # d, m ~ +-0.008
    return QuantizedWeight(QuantFormat.Q4_1, blocks, k)


def model_layer(path: Path, layer: int) -> list[QuantizedWeight]:
    """One layer's fused projections in the blocks the loader serves them in."""
    reader = open_gguf(path)
    source = GGUFTensorSource(reader, gguf_arch(reader))
    weights = []
    for names in linear_sources(layer).values():
        parts = [source.load_quantized(name) for name in names]
        if any(p is None for p in parts):
            raise SystemExit(f"{path.name} layer {layer}: {names} not served in blocks")
        ready = [p for p in parts if p is not None]
        if len({p.fmt for p in ready}) > 1:  # the float kernel takes one format a matrix
            print(f"layer {layer}: {names} in two formats, measured part by part")
            weights += ready
            continue
        weights.append(QuantizedWeight.cat(ready))
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 96])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--model", type=Path, help="a GGUF file: one of its layers instead")
    ap.add_argument("--layer", type=int, default=0)
    ns = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if ns.model is not None:
        weights = model_layer(ns.model.expanduser(), ns.layer)
    else:
        weights = [random_q4_1(n, k, gen) for n, k in SHAPES]
    shapes = [(w.out_features, w.in_features) for w in weights]
    packed = [pack_int8(w) for w in weights]
    kernels: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "float": lambda x, i: quant_linear(x, weights[i]),
        "int8": lambda x, i: int8_linear(x, packed[i]),
    }
    if ns.model is not None:
        dense = [dequantize(w) for w in weights]
        kernels["torch fp32"] = lambda x, i: F.linear(x, dense[i])
    print(f"{torch.get_num_threads()} threads; " + ", ".join(
        f"{w.fmt.name} {n}x{k}" for w, (n, k) in zip(weights, shapes, strict=True)
    ))  # fmt: skip
    for m in ns.rows:
        xs = [torch.randn(m, k, generator=gen) for _, k in shapes]
        flops = sum(2 * m * n * k for n, k in shapes)
        line = [f"M={m:3d}:"]
        for name, kernel in kernels.items():
            per_layer = _time_layer(kernel, xs, ns.reps)
            line.append(
                f"{name} {per_layer * 1e3:6.2f} ms a layer, {flops / per_layer / 1e9:6.1f} GFLOP/s;"
            )
        print(" ".join(line))


def _time_layer(
    kernel: Callable[[torch.Tensor, int], torch.Tensor], xs: list[torch.Tensor], reps: int
) -> float:
    for _ in range(3):
        for i, x in enumerate(xs):
            kernel(x, i)
    start = time.perf_counter()
    for _ in range(reps):
        for i, x in enumerate(xs):
            kernel(x, i)
    return (time.perf_counter() - start) / reps


if __name__ == "__main__":
    main()
