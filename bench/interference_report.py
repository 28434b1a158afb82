"""Tables and plots of bench/interference.py's raw results (times in seconds since the baseline
window began, ITL and TTFT in milliseconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import percentile


def summarize(mode: str, raw: dict[str, Any]) -> dict[str, Any]:
    (b0, b1), (i0, i1) = raw["windows"]["baseline"], raw["windows"]["interference"]
    base = [g for t, g in raw["gaps"] if b0 <= t < b1]
    intf = [g for t, g in raw["gaps"] if i0 <= t <= i1]
    shorts = {k: [1e3 * s["ttft_s"] for s in raw["samples"] if s["kind"] == f"short {k}"]
              for k in ("baseline", "interference")}  # fmt: skip
    during = [s["during_prefill"] for s in raw["samples"] if s["kind"] == "short interference"]
    longs = [s for s in raw["samples"] if s["kind"].startswith("long")]
    for s in longs:  # the worst stream stall while this prompt was being prefilled
        stall = [g for t, g in raw["gaps"] if s["sent_s"] <= t <= s["first_s"]]
        s["max_itl_during_prefill_ms"] = max(stall, default=float("nan"))
    p99_base, p99_intf = percentile(base, 99), percentile(intf, 99)
    return {
        "mode": mode, "itl_p50_base_ms": percentile(base, 50), "itl_p99_base_ms": p99_base,
        "itl_p50_intf_ms": percentile(intf, 50), "itl_p99_intf_ms": p99_intf,
        "p99_ratio": p99_intf / p99_base, "itl_max_intf_ms": max(intf, default=float("nan")),
        "chunks_per_s_base": (len(base) / (b1 - b0)), "chunks_per_s_intf": len(intf) / (i1 - i0),
        "short_ttft_p50_base_ms": percentile(shorts["baseline"], 50),
        "short_ttft_p50_intf_ms": percentile(shorts["interference"], 50),
        "short_ttft_p99_intf_ms": percentile(shorts["interference"], 99),
        "shorts_during_prefill": f"{sum(bool(d) for d in during)}/{len(during)}",
        "long_ttft_s": [round(s["ttft_s"], 2) for s in longs],
        "long_prompt_tokens": [s["prompt_tokens"] for s in longs],
        "stream_errors": len(raw["stream_errors"]),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | ITL p50 base | ITL p99 base | ITL p50 intf | ITL p99 intf | p99 intf/base | "
             "ITL max intf | chunks/s base / intf | short TTFT p50 base | short TTFT p50 / p99 intf "
             "| shorts in prefill | long TTFT s (prompt tokens) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        longs = ", ".join(
            f"{t} ({n})" for t, n in zip(r["long_ttft_s"], r["long_prompt_tokens"], strict=True)
        )
        lines.append(
            f"| {r['mode']} | {r['itl_p50_base_ms']:.1f} | {r['itl_p99_base_ms']:.1f} | "
            f"{r['itl_p50_intf_ms']:.1f} | {r['itl_p99_intf_ms']:.1f} | {r['p99_ratio']:.2f} | "
            f"{r['itl_max_intf_ms']:.0f} | {r['chunks_per_s_base']:.1f} / {r['chunks_per_s_intf']:.1f} | "
            f"{r['short_ttft_p50_base_ms']:.0f} | {r['short_ttft_p50_intf_ms']:.0f} / "
            f"{r['short_ttft_p99_intf_ms']:.0f} | {r['shorts_during_prefill']} | {longs} | "
            f"{r['stream_errors']} |"
        )  # fmt: skip
    return "\n".join(lines)


def timeline(ax: Any, res: dict[str, Any]) -> None:
    """Every ITL gap of every stream over time, with each long prompt's prefill shaded."""
    gaps = [(t, g) for t, g in res["raw"]["gaps"] if t >= 0]
    # each gap drawn across the time it spans, so a stall reads as a long, high segment
    ax.hlines([g for _, g in gaps], [t - g / 1e3 for t, g in gaps], [t for t, _ in gaps],
              lw=1.5, alpha=0.4, label="ITL gap, over its span")  # fmt: skip
    ax.axvline(res["raw"]["windows"]["interference"][0], color="k", ls="--", lw=1)
    for s in res["raw"]["samples"]:
        if s["kind"].startswith("long"):
            ax.axvspan(s["sent_s"], s["first_s"], color="tab:red", alpha=0.15)
            ax.text(s["sent_s"], 1.0, s["kind"][5:], transform=ax.get_xaxis_transform(),
                    va="top", fontsize=8)  # fmt: skip
        elif s["kind"].startswith("short"):
            ax.axvline(s["sent_s"], color="tab:green", lw=0.8)
    ax.set(yscale="log", ylabel="ITL (ms)")
    ax.set_title(f"{res['mode']}: stream ITL over time (red: a long prompt from sent to first "
                 "token; green: a short prompt sent)", fontsize=9)  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig = plt.figure(figsize=(15, 2.8 * n + 1))
    grid = fig.add_gridspec(n, 3)
    for k, res in enumerate(results):
        ax = fig.add_subplot(grid[k, :2])
        timeline(ax, res)
    ax.set_xlabel("seconds since the baseline window began (dashed: interference starts)")
    bars = fig.add_subplot(grid[:, 2])
    rows = [r["summary"] for r in results]
    xs = range(len(rows))
    bars.bar([x - 0.2 for x in xs], [r["itl_p99_base_ms"] for r in rows], 0.4, label="baseline")
    bars.bar([x + 0.2 for x in xs], [r["itl_p99_intf_ms"] for r in rows], 0.4, label="interference")
    for x, r in zip(xs, rows, strict=True):
        bars.text(x + 0.2, r["itl_p99_intf_ms"], f"{r['p99_ratio']:.1f}x", ha="center", va="bottom")
    bars.set_xticks(list(xs), [r["mode"] for r in rows])
    bars.set(ylabel="ITL p99 (ms)", title="ITL p99: baseline vs interference (ratio on top)")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
