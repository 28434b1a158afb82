"""Expert load balancing under skewed, drifting routing: a Mixture-of-Experts layer of realistic
shape (64 experts, top 8) over 4 expert-parallel groups, with a static placement (contiguous
blocks of experts, EPLB off) and with `balanced_placement` re-placing experts from the last
window's load every `--interval` steps (EPLB on, `--redundant` extra replicas).

Routing: each token picks `--top-k` distinct experts with probabilities following a Zipf law
over a ranking of the experts that drifts (a few neighbouring ranks swap every step), so the hot
experts change over time. Reported per mode, over the steps after the first window: the mean
max/mean group load (tokens each group computes; a replicated expert's tokens split evenly over
its replicas) and the step time of the layer's experts, the slowest group's: each group's
runs of rows as the serving path splits them (`split_rows`; one matmul pair each, float32, one
thread) are timed on their own,
as the groups run in parallel on their own devices (this 2-core machine times them in turn).

    python bench/moe.py
    python bench/moe.py --steps 400 --interval 50 --redundant 8 --zipf 1.1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import provenance

from deepinfer.model.experts.placement import (
    ExpertSlice,
    balanced_placement,
    split_rows,
    static_placement,
)


def popularity(ranking: list[int], s: float) -> torch.Tensor:
    """Routing probability per expert: Zipf over its rank."""
    weights = torch.empty(len(ranking))
    for rank, expert in enumerate(ranking):
        weights[expert] = 1.0 / (rank + 1) ** s
    return weights / weights.sum()


def drift(ranking: list[int], rng: random.Random, swaps: int) -> None:
    for _ in range(swaps):
        i = rng.randrange(len(ranking) - 1)
        ranking[i], ranking[i + 1] = ranking[i + 1], ranking[i]


def group_time(slices: list[ExpertSlice], w1: torch.Tensor, w2: torch.Tensor) -> float:
    """Seconds for one group's runs of rows (one gate_up and one down matmul each)."""
    start = time.perf_counter()
    for s in slices:
        x = torch.randn(s.count, w1.shape[2])
        gate, up = (x @ w1[s.expert].t()).chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up) @ w2[s.expert].t()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=int, default=50, help="EPLB re-placement period (steps)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--swaps", type=int, default=2, help="rank swaps per step (drift)")
    ap.add_argument("--time-every", type=int, default=5, help="time one step in this many")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    w1 = torch.randn(ns.experts, 2 * ns.expert_width, ns.hidden) * 0.02
    w2 = torch.randn(ns.experts, ns.hidden, ns.expert_width) * 0.02
    ranking = list(range(ns.experts))
    rng.shuffle(ranking)
    static = static_placement(ns.experts, ns.groups)
    balanced = static
    window = [0] * ns.experts
    stats: dict[str, dict[str, list[float]]] = {
        m: {"imbalance": [], "time": []} for m in ("EPLB off", "EPLB on")
    }
    for step in range(ns.steps):
        probs = popularity(ranking, ns.zipf)
        picks = torch.multinomial(probs.expand(ns.tokens, -1), ns.top_k, replacement=False)
        counts = torch.bincount(picks.reshape(-1), minlength=ns.experts).tolist()
        if step >= ns.interval:  # after the first window: EPLB has seen traffic
            for mode, placement in (("EPLB off", static), ("EPLB on", balanced)):
                stats[mode]["imbalance"].append(placement.imbalance(counts))
                if step % ns.time_every == 0:
                    times = [group_time(g, w1, w2) for g in split_rows(placement, counts)]
                    stats[mode]["time"].append(max(times))
        window = [w + c for w, c in zip(window, counts, strict=True)]
        if (step + 1) % ns.interval == 0:
            balanced = balanced_placement(window, ns.groups, ns.redundant)
            window = [0] * ns.experts
        drift(ranking, rng, ns.swaps)
    print(f"\n### Expert load balancing: `bench/moe.py`\n\n{provenance()}\n")
    print(
        f"{ns.experts} experts, top {ns.top_k}, {ns.groups} groups, {ns.redundant} redundant "
        f"replicas, {ns.tokens} tokens a step, hidden {ns.hidden}, expert width "
        f"{ns.expert_width}, Zipf s={ns.zipf} drifting {ns.swaps} swaps a step, re-placed every "
        f"{ns.interval} steps; {ns.steps - ns.interval} steps measured\n"
    )
    print("| mode | max/mean group load (mean) | (p90) | experts' step time, slowest group (ms) |")
    print("|---|---|---|---|")
    for mode, s in stats.items():
        imb = sorted(s["imbalance"])
        p90 = imb[int(0.9 * (len(imb) - 1))]
        print(f"| {mode} | {statistics.mean(imb):.3f} | {p90:.3f} | "
              f"{1e3 * statistics.median(s['time']):.2f} |")  # fmt: skip
    off, on = (statistics.median(stats[m]["time"]) for m in stats)
    print(f"\nstep time, EPLB on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
