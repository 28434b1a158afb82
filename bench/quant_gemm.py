"""The native Q4_1 matmuls alone: GFLOP/s of one SmolLM2 layer's four projections at M rows.

Random Q4_1 blocks of SmolLM2's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536); one layer's weights (2.2 MB) stay in cache, so this is the kernels' arithmetic rate,
not the weight stream's. Both kernels run in the same process, alternating: `float` (tiles
dequantized to fp32, exact weights) and `int8` (activations quantized, integer dot products).
Run from the repository root:

    python -m bench.quant_gemm --rows 1 8 32 96
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from deepinfer.kernels.int8_matmul import int8_linear, pack_int8
from deepinfer.kernels.quant_matmul import QK, QuantFormat, QuantizedWeight, quant_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    nb = k // QK
    blocks = torch.randint(0, 256, (n, nb * 20), dtype=torch.uint8, generator=gen)
    scales = blocks.view(n, nb, 20)
    scales[:, :, 0:4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)  # d, m ~ +-0.008
    return QuantizedWeight(QuantFormat.Q4_1, blocks, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 96])
    ap.add_argument("--reps", type=int, default=30)
    ns = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [random_q4_1(n, k, gen) for n, k in SHAPES]
    packed = [pack_int8(w) for w in weights]
    kernels: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "float": lambda x, i: quant_linear(x, weights[i]),
        "int8": lambda x, i: int8_linear(x, packed[i]),
    }
    print(f"{torch.get_num_threads()} threads")
    for m in ns.rows:
        xs = [torch.randn(m, k, generator=gen) for _, k in SHAPES]
        flops = sum(2 * m * n * k for n, k in SHAPES)
        line = [f"M={m:3d}:"]
        for name, kernel in kernels.items():
            per_layer = _time_layer(kernel, xs, ns.reps)
            line.append(
                f"{name} {per_layer * 1e3:6.2f} ms a layer, {flops / per_layer / 1e9:6.1f} GFLOP/s "
                f"({per_layer * 30e3:6.1f} ms for 30 layers);"
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
