"""Expert parallelism: a Mixture-of-Experts layer's experts placed over N groups, each computing
its share of a step's rows, and the load balancer (EPLB) re-placing them between steps.

The layer routes its tokens and sorts the (token, expert) pairs by expert as without groups
(`kernels/moe/moe_torch.combine_pairs`); `ExpertParallel.run` splits those sorted rows by the
layer's current `Placement` (a replicated expert's rows in contiguous runs, one per replica:
`model/expert_placement.split_rows`), has every group compute its runs at once (group 0 on
the calling thread, the others on threads of their own: a GPU each, or a CPU thread group, or a
process reached through torch.distributed, `runner/expert_ranks.py`), and puts each run's
outputs back where its rows were. The gated sum then adds a token's contributions in the same
order whatever the placement: an expert's row is the same arithmetic on any group, so outputs
do not depend on N or on replicas (bitwise where the FFN's rows are independent of each
other: the quantized CPU kernel, batch-invariant mode).

EPLB: every `eplb_interval` steps each sparse layer gets a placement balanced on the tokens its
experts received since the last one (`balanced_placement`, `redundant` extra replicas; over
several machines `hierarchical_placement`, machines first). Each
group loads its new experts beside the ones it holds (`ExpertGroup.place`: the previous set
stays until the next placement, so a step still running on the old one finds its experts), then
the layer's placement is swapped: the next step uses it, no step waits for more than the loads.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.kernels.moe.moe_torch import RunExperts
from deepinfer.model.experts.placement import (
    ExpertParallelStats,
    ExpertSlice,
    Placement,
    balanced_placement,
    hierarchical_placement,
    split_rows,
    static_placement,
)

LayerRunners = Callable[[int], RunExperts]
"""Layer index -> that layer's experts, run by runs of rows (on the weights' own device)."""


class ExpertGroup(Protocol):
    """One group of the placement: a device of this process, or another process."""

    failed: str | None
    """Why the group is out of service, its runs computed by a stand-in (None: serving)."""

    def run(
        self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]
    ) -> torch.Tensor:  # the slices' rows' outputs, concatenated in slice order
        ...

    def place(self, layer: int, experts: tuple[int, ...]) -> None:
        """Hold `experts` of `layer` from now on (beside the previous set, until the next)."""
        ...

    def close(self) -> None: ...


class LocalGroup:
    """A group of this process: on the weights' own device it reads them in place; on another
    device (a GPU of its own) it holds copies of its experts' weights, on a stream of its own."""

    failed: str | None = None

    def __init__(
        self,
        device: torch.device,
        runners: LayerRunners,
        weights: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self._runners = runners
        self._weights = weights
        """(layer, expert) -> its (gate_up, down), to copy when the group is on another device."""
        self._activation = activation
        self._linear = linear or _linear
        """x [n, in], w [out, in] -> x @ w.T for copied experts (the fixed-order matmul in the
        batch-invariant mode)."""
        self._held: dict[int, tuple[dict[int, ExpertWeights], dict[int, ExpertWeights]]] = {}
        """layer -> (current experts, previous experts), each expert -> its weights (None: in
        place, on the source device)."""
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def place(self, layer: int, experts: tuple[int, ...]) -> None:
        current, _ = self._held.get(layer, ({}, {}))
        fresh = {e: current[e] if e in current else self._load(layer, e) for e in experts}
        self._held[layer] = (fresh, current)

    def _load(self, layer: int, expert: int) -> ExpertWeights:
        if self._weights is None:
            return None
        gate_up, down = self._weights(layer, expert)
        return ExpertCopy(gate_up.to(self.device), down.to(self.device))

    def run(self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]) -> torch.Tensor:
        if self._stream is None:
            return self._run(layer, rows, slices)
        with torch.cuda.stream(self._stream):
            out = self._run(layer, rows, slices)
        self._stream.synchronize()
        return out

    def run_any(
        self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]
    ) -> torch.Tensor:
        """`run` for any experts, held or not (a group on the weights' own device reads every
        expert in place: another group's stand-in)."""
        if self._weights is not None:
            raise ValueError("a group holding copies computes only its own experts")
        x = torch.cat([rows[s.start : s.start + s.count] for s in slices])
        return self._runners(layer)(x, [(s.expert, s.count) for s in slices])

    def _run(self, layer: int, rows: torch.Tensor, slices: Sequence[ExpertSlice]) -> torch.Tensor:
        current, previous = self._held[layer]
        held = [current[s.expert] if s.expert in current else previous[s.expert] for s in slices]
        x = torch.cat([rows[s.start : s.start + s.count] for s in slices])
        x = x.to(self.device, non_blocking=True)
        if all(h is None for h in held):  # in place: every run in one call
            y = self._runners(layer)(x, [(s.expert, s.count) for s in slices])
            return y.to(rows.device)
        assert self._activation is not None
        outs, start = [], 0
        for s, copy in zip(slices, held, strict=True):
            assert copy is not None
            part = x[start : start + s.count]
            outs.append(self._linear(self._activation(self._linear(part, copy.gate_up)), copy.down))
            start += s.count
        return torch.cat(outs).to(rows.device)

    def close(self) -> None:
        self._held.clear()


@dataclass(frozen=True)
class ExpertCopy:
    gate_up: torch.Tensor  # [2I, D]
    down: torch.Tensor  # [D, I]


ExpertWeights = ExpertCopy | None


@dataclass
class EPLBStats:
    """What the balancer did: placements computed and layers whose experts moved."""

    rebalances: int = 0
    swaps: int = 0
    steps: int = 0


class ExpertParallel:
    """The groups of every sparse layer of one model (shared by its replicas) and their
    placements; `run` is the layers' seam, `end_step` the balancer's."""

    def __init__(
        self,
        groups: Sequence[ExpertGroup],
        placements: dict[int, Placement],
        *,
        eplb_interval: int = 0,
        redundant: int = 0,
        nodes: int = 1,
        after_close: Callable[[], None] | None = None,
    ) -> None:
        self.groups = list(groups)
        self._after_close = after_close
        self.placements = dict(placements)
        """Sparse layer -> its current placement (replaced whole on a swap)."""
        self.eplb_interval = eplb_interval
        self.redundant = redundant
        self.nodes = nodes
        """Machines the groups span, the same number each (> 1: the hierarchical policy)."""
        self.stats = EPLBStats()
        self._window = {layer: [0] * _num_experts(p) for layer, p in placements.items()}
        self._group_rows = [0] * len(self.groups)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = dict.fromkeys(placements, 0)
        """Runs of each layer under way: a layer is re-placed only when it has none, so a run
        only ever reads the current placement's experts or the previous one's."""
        self._pool = (
            ThreadPoolExecutor(len(self.groups) - 1, thread_name_prefix="deepinfer-experts")
            if len(self.groups) > 1
            else None
        )
        for layer, placement in self.placements.items():
            self._place(layer, placement)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def run(self, layer: int, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Sorted pair rows of `layer` (`counts[e]` for expert e) -> their FFN outputs."""
        with self._lock:
            window = self._window[layer]
            for e, n in enumerate(counts):
                window[e] += n
            self._in_flight[layer] += 1
            slices = split_rows(self.placements[layer], counts)
            for g, mine in enumerate(slices):
                self._group_rows[g] += sum(s.count for s in mine)
        try:
            return self._run(layer, rows, slices)
        finally:
            with self._lock:
                self._in_flight[layer] -= 1
                self._idle.notify_all()

    def _run(self, layer: int, rows: torch.Tensor, slices: list[list[ExpertSlice]]) -> torch.Tensor:
        if rows.is_cuda:  # written on the caller's stream; the groups read on streams of their own
            torch.cuda.current_stream(rows.device).synchronize()
        pending: list[tuple[Sequence[ExpertSlice], Future[torch.Tensor]]] = []
        for group, mine in zip(self.groups[1:], slices[1:], strict=True):
            if mine:
                assert self._pool is not None
                pending.append((mine, self._pool.submit(group.run, layer, rows, mine)))
        out = torch.empty_like(rows)
        if here := slices[0]:
            _put(out, here, self.groups[0].run(layer, rows, here))
        for theirs, future in pending:
            _put(out, theirs, future.result())
        return out

    def snapshot(self) -> ExpertParallelStats:
        """The groups' work and the balancer's, for /metrics."""
        with self._lock:
            st, rows = self.stats, tuple(self._group_rows)
            placements = dict(self.placements)
        return ExpertParallelStats(
            self.num_groups, st.steps, st.rebalances, st.swaps, rows,
            {layer: tuple(p.replicas(_num_experts(p))) for layer, p in placements.items()},
            tuple(g for g, group in enumerate(self.groups) if group.failed is not None),
        )  # fmt: skip

    def end_step(self) -> None:
        """After each forward pass: every `eplb_interval` steps, re-place every sparse layer."""
        with self._lock:
            self.stats.steps += 1
            due = self.eplb_interval > 0 and self.stats.steps % self.eplb_interval == 0
            if not due:
                return
            loads = {layer: window[:] for layer, window in self._window.items()}
            for window in self._window.values():
                window[:] = [0] * len(window)
        self.rebalance(loads)

    def rebalance(self, loads: dict[int, list[int]]) -> None:
        """Balanced placements for these per-layer loads, loaded and swapped in."""
        with self._lock:
            self.stats.rebalances += 1
        for layer, load in loads.items():
            if not any(load):
                continue
            placement = self._balanced(load)
            if placement == self.placements[layer]:
                continue
            with self._lock:
                self._idle.wait_for(functools.partial(self._layer_idle, layer))
                self._place(layer, placement)  # beside the old experts: a run may start now
                self.placements[layer] = placement
                self.stats.swaps += 1

    def _balanced(self, load: list[int]) -> Placement:
        if self.nodes > 1:
            per_node = self.num_groups // self.nodes
            return hierarchical_placement(load, self.nodes, per_node, self.redundant)
        return balanced_placement(load, self.num_groups, self.redundant)

    def _layer_idle(self, layer: int) -> bool:
        return self._in_flight[layer] == 0

    def _place(self, layer: int, placement: Placement) -> None:
        for group, experts in zip(self.groups, placement.groups, strict=True):
            group.place(layer, experts)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for group in self.groups:
            group.close()
        if self._after_close is not None:
            self._after_close()


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


def _put(out: torch.Tensor, slices: Sequence[ExpertSlice], values: torch.Tensor) -> None:
    offset = 0
    for s in slices:
        out[s.start : s.start + s.count] = values[offset : offset + s.count]
        offset += s.count


def _num_experts(placement: Placement) -> int:
    return 1 + max(e for group in placement.groups for e in group)


def initial_placement(num_experts: int, num_groups: int, redundant: int) -> Placement:
    """Before any traffic: experts in contiguous blocks, or with replicas every expert taken
    as equally loaded (the replicas go to the lowest experts)."""
    if redundant == 0:
        return static_placement(num_experts, num_groups)
    return balanced_placement([1.0] * num_experts, num_groups, redundant)
