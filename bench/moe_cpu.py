"""A Mixture-of-Experts layer's quantized experts on CPU: the one-call native kernel
(`kernels/moe/moe_cpu.py`) against three Python calls a run of rows (`block_linear`, `silu_mul`,
`block_linear`, the path it replaces; bit-identical outputs, checked here too), alternated in
one run.

Experts of realistic shape (64, hidden 1024, width 256 by default, Q4_K blocks as llama.cpp's
Q4_K_M files hold them, int8 activations as served by default) and a step's rows routed top 8
under a Zipf law, for steps of 1, 8, 32 and 256 tokens (decode batches and a prefill chunk).

    python bench/moe_cpu.py
    python bench/moe_cpu.py --experts 128 --hidden 2048 --width 768 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from gguf_weights import gguf_weight

from deepinfer.kernels.elementwise.elementwise_cpu import silu_mul_cpu
from deepinfer.kernels.linear.int8_matmul import block_linear, pack_int8
from deepinfer.kernels.linear.quant_matmul import QuantFormat
from deepinfer.kernels.moe.moe_cpu import NativeExperts
from deepinfer.kernels.moe.moe_torch import run_each, runs_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--zipf", type=float, default=1.1)
    ns = ap.parse_args()
    fmt = QuantFormat.Q4_K
    gate_up = [
        pack_int8(gguf_weight(fmt, 2 * ns.width, ns.hidden, e)[0]) for e in range(ns.experts)
    ]
    down = [
        pack_int8(gguf_weight(fmt, ns.hidden, ns.width, 1000 + e)[0]) for e in range(ns.experts)
    ]
    native = NativeExperts(gate_up, down)

    def ffn(expert: int, x: torch.Tensor) -> torch.Tensor:
        return block_linear(silu_mul_cpu(block_linear(x, gate_up[expert])), down[expert])

    python = run_each(ffn)
    ranks = torch.arange(1, ns.experts + 1, dtype=torch.float32)
    probs = 1.0 / ranks**ns.zipf
    print(f"\n### MoE experts on CPU: `bench/moe_cpu.py`\n\n{provenance()}\n")
    print(
        f"{ns.experts} experts, top {ns.top_k}, hidden {ns.hidden}, width {ns.width}, Q4_K "
        f"weights, int8 activations, {torch.get_num_threads()} threads, Zipf s={ns.zipf}; "
        f"median of {ns.repeats} alternated runs\n"
    )
    print("| tokens | runs | Python, 3 calls a run (ms) | native, one call (ms) | speed-up |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 8, 32, 256):
        picks = torch.multinomial(probs.expand(tokens, -1), ns.top_k, generator=gen)
        counts = torch.bincount(picks.reshape(-1), minlength=ns.experts).tolist()
        runs = runs_of(counts)
        rows = torch.randn(tokens * ns.top_k, ns.hidden, generator=gen)
        assert torch.equal(python(rows, runs), native.run(rows, runs))
        times: dict[str, list[float]] = {"python": [], "native": []}
        for _ in range(ns.repeats):
            for name, run in (("python", python), ("native", native.run)):
                start = time.perf_counter()
                run(rows, runs)
                times[name].append(time.perf_counter() - start)
        py, nat = (1e3 * statistics.median(times[k]) for k in ("python", "native"))
        print(f"| {tokens} | {len(runs)} | {py:.2f} | {nat:.2f} | {py / nat:.2f}x |")


if __name__ == "__main__":
    main()
