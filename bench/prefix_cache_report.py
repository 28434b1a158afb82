"""The prefix-cache benchmark's records and their report: per-scenario samples, the table, the
verdicts against the targets, and the plot (`bench/prefix_cache.py` runs the scenarios)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import percentile


@dataclass
class Sample:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Scenario:
    name: str
    samples: list[Sample] = field(default_factory=list)
    disk_tokens: int | None = None
    """Prompt tokens loaded from the disk tier (deepinfer's /metrics counter, before/after)."""

    def row(self) -> dict[str, Any]:
        ttft = [s.ttft_s for s in self.samples]
        prompt = sum(s.prompt_tokens for s in self.samples)
        cached = sum(s.cached_tokens for s in self.samples)
        return {
            "scenario": self.name, "requests": len(self.samples), "input_tokens": prompt,
            "cached_share": cached / prompt if prompt else float("nan"),
            "disk_tokens": self.disk_tokens,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | requests | input tokens | cached share | disk tokens | TTFT p50 ms | "
             "TTFT p99 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        disk = "n/a" if r["disk_tokens"] is None else str(r["disk_tokens"])
        lines.append(
            f"| {r['scenario']} | {r['requests']} | {r['input_tokens']} | "
            f"{100 * r['cached_share']:.1f}% | {disk} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} |"
        )
    return "\n".join(lines)


def verdicts(rows: dict[str, dict[str, Any]]) -> str:
    def ratio(a: str, b: str) -> float:
        return float(rows[a]["ttft_p50_ms"] / rows[b]["ttft_p50_ms"])

    share = rows["cached"]["cached_share"]
    llama = rows.get("llama-server")
    cached_vs_none, resumed_vs_cold = (
        ratio("cached", "no cache"),
        ratio("resumed after restart", "cold (empty cache dir)"),
    )
    checks = [
        (f"cached share of input tokens {100 * share:.1f}% (target >= 95%)", share >= 0.95),
        (f"TTFT p50 cached / no cache = {cached_vs_none:.3f} (target <= 0.2)", cached_vs_none <= 0.2),
        (f"TTFT p50 resumed / cold = {resumed_vs_cold:.3f} (target <= 0.3)", resumed_vs_cold <= 0.3),
    ]  # fmt: skip
    if llama is not None:
        p99 = rows["cached"]["ttft_p99_ms"] / llama["ttft_p99_ms"]
        checks.append((f"TTFT p99 cached / llama-server = {p99:.3f} (target <= 0.2)", p99 <= 0.2))
    return "\n".join(f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in checks)


def plot(scenarios: list[Scenario], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_turn, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    for s in scenarios:
        turns = sorted({x.turn for x in s.samples})
        if len(turns) < 2:
            continue
        p50 = [1e3 * percentile([x.ttft_s for x in s.samples if x.turn == t], 50) for t in turns]
        by_turn.plot(turns, p50, marker="o", label=s.name)
    by_turn.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="TTFT by turn", yscale="log")
    by_turn.xaxis.get_major_locator().set_params(integer=True)
    by_turn.legend()
    rows = [s.row() for s in scenarios]
    xs = range(len(rows))
    bars.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    bars.bar([x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in rows], 0.4, label="p99")
    bars.set_xticks(list(xs), [str(r["scenario"]) for r in rows], rotation=20, ha="right")
    bars.set(ylabel="TTFT (ms)", title="TTFT by scenario", yscale="log")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
