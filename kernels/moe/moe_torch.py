"""Mixture-of-Experts in torch: the router's gates and the grouped expert FFN (the reference the
native and Triton kernels are tested against, and the path every device can run).

The grouped FFN sorts the (token, expert) pairs of a step by expert, so each expert's rows are
multiplied once per step, then adds each pair's gated output back to its token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Activation = Callable[[torch.Tensor], torch.Tensor]
"""[n, 2I] (gate; up) -> [n, I]."""
ExpertFFN = Callable[[int, torch.Tensor], torch.Tensor]
"""(expert, its rows [n, D]) -> its FFN of them [n, D]."""


def float_experts(
    w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: Activation
) -> ExpertFFN:
    """Experts stacked as [E, 2I, D] (rows [gate; up]) and [E, D, I]."""

    def ffn(expert: int, x: torch.Tensor) -> torch.Tensor:
        return activation(x @ w_gate_up[expert].t()) @ w_down[expert].t()

    return ffn


def route(
    logits: torch.Tensor,  # [T, E], any float dtype
    top_k: int,
    routing: str = "softmax_topk",
    renormalize: bool = True,
    scaling: float = 1.0,
    bias: torch.Tensor | None = None,  # [E]: added to the scores that choose (sigmoid_topk)
    num_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32 gates, [T, k] int64 experts)
    """Each token's `top_k` experts and their gates, computed in float32.

    `softmax_topk`: softmax over every expert, the top k probabilities (then divided by their sum
    with `renormalize`); `topk_softmax`: the top k logits, then a softmax over them alone;
    `sigmoid_topk`: `sigmoid_topk` below. Ties go to the lower expert index (torch.topk on CPU
    and CUDA alike)."""
    logits = logits.float()
    if routing == "sigmoid_topk":
        return sigmoid_topk(logits, top_k, renormalize, scaling, bias, num_groups, topk_groups)
    if routing == "topk_softmax":
        top, experts = torch.topk(logits, top_k, dim=-1)
        gates = torch.softmax(top, dim=-1)
    elif routing == "softmax_topk":
        gates, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    if scaling != 1.0:
        gates = gates * scaling
    return gates, experts


def sigmoid_topk(
    logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    renormalize: bool,
    scaling: float,
    bias: torch.Tensor | None,
    num_groups: int,
    topk_groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: scores sigmoid(logits); experts chosen by score + bias, only among
    the `topk_groups` groups (of `num_groups` equal ones) whose two best choosing scores sum
    highest; gates are the chosen experts' scores (divided by their sum with `renormalize`,
    then times `scaling`)."""
    scores = torch.sigmoid(logits)
    choosing = scores if bias is None else scores + bias.float()
    if topk_groups < num_groups:
        t, e = choosing.shape
        grouped = choosing.view(t, num_groups, e // num_groups)
        best = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, torch.topk(best, topk_groups, dim=-1).indices, True)
        choosing = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    experts = torch.topk(choosing, top_k, dim=-1).indices
    gates = scores.gather(1, experts)
    if renormalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return gates * scaling, experts


def grouped_experts(
    h: torch.Tensor,  # [T, D]
    experts: torch.Tensor,  # [T, k] int64
    gates: torch.Tensor,  # [T, k] float32
    ffn: ExpertFFN,
    counts: list[int],
) -> torch.Tensor:  # [T, D], h's dtype
    """sum over k of gates[t, k] * FFN_{experts[t, k]}(h[t]), each expert's rows in one call of
    `ffn` (`counts`: how many pairs each expert has, `expert_counts`). A token's k contributions
    are added in the order of its pairs sorted by expert."""
    return combine_pairs(h, experts, gates, each_expert(ffn, counts))


SortedFFN = Callable[[torch.Tensor], torch.Tensor]
"""A step's pair rows sorted by expert [n, D] -> each row's expert FFN of it [n, D]."""
Run = tuple[int, int]
"""(expert, rows): consecutive rows all routed to one expert."""
RunExperts = Callable[[torch.Tensor, Sequence[Run]], torch.Tensor]
"""Rows [n, D] in runs (consecutive, in run order) -> each row's expert FFN of it [n, D]."""


def runs_of(counts: list[int]) -> list[Run]:
    """The runs of a step's rows sorted by expert (`counts[e]` rows for expert e)."""
    return [(e, n) for e, n in enumerate(counts) if n]


def run_each(ffn: ExpertFFN) -> RunExperts:
    """Runs through `ffn`, one call per run."""

    def run(rows: torch.Tensor, runs: Sequence[Run]) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for expert, n in runs:
            out[start : start + n] = ffn(expert, rows[start : start + n])
            start += n
        return out

    return run


def each_expert(ffn: ExpertFFN, counts: list[int]) -> SortedFFN:
    """Sorted rows through `ffn`, one call per expert with rows (`counts[e]` of them)."""
    runs = runs_of(counts)
    return lambda rows: run_each(ffn)(rows, runs)


def combine_pairs(
    h: torch.Tensor,  # [T, D]
    experts: torch.Tensor,  # [T, k] int64
    gates: torch.Tensor,  # [T, k] float32
    run: SortedFFN,
) -> torch.Tensor:  # [T, D], h's dtype
    """Sorts the (token, expert) pairs by expert (stable), has `run` compute their rows, and
    adds each pair's gated output to its token, in that sorted order: however `run` splits the
    rows (one device, or expert-parallel groups), the sums are the same."""
    top_k = experts.shape[1]
    order = torch.argsort(experts.reshape(-1), stable=True)  # pairs grouped by expert
    tokens = order // top_k
    out = run(h[tokens])  # [T*k, D], sorted by expert
    out = out * gates.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(h).index_add_(0, tokens, out)


def expert_counts(experts: torch.Tensor, num_experts: int) -> list[int]:
    """How many of a step's (token, expert) pairs each expert has."""
    counts: list[int] = torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    return counts


def naive_experts(
    h: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, ffn: ExpertFFN
) -> torch.Tensor:
    """`grouped_experts` one token and one expert at a time (the tests' reference)."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(experts.shape[1]):
            y = ffn(int(experts[t, j]), h[t : t + 1])
            out[t] += (gates[t, j].to(h.dtype) * y)[0]
    return out
