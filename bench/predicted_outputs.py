"""Predicted Outputs against plain decoding, engine only (the embedding API, no HTTP), with the
default flags: a coding agent's edits of a ~30-line file (`speculative.py`'s agent workload:
rename a function, add a docstring line, change an argument), each request sent with the file as
it was before the edit as its `prediction`, as an editor sends it, and without.

Each round runs every edit one request at a time in both modes, back to back, the mode that goes
first alternating from round to round (single stream: decode tokens/s from the first token to
the last), then `--streams` requests at once (the edits cycled), each mode's batch timed from
the first submit to the last token (tokens/s over that wall time). The outputs with a prediction
are checked equal to those without, token for token (every run of a prompt starts from its
prefix in the cache: with int8 activations a prefix computed in the same step and one read from
the cache can decode differently); the table gives medians over the rounds
and the prediction's accepted tokens (verified as drafts and kept) and rejected ones. A third
mode, `answer`, sends the plain run's own answer as the prediction: the ceiling, where every
predicted token is the model's.

`--speculative` gives the engine a proposer besides predictions (suffix decoding, say, drafting
what a prediction cannot: the answer's opening and closing sentences, from the tenant's earlier
answers). `plain` is then plain decoding (the drafter taken away), and a fourth mode,
`flags`, the proposer without a prediction. Suffix decoding's stores of earlier outputs are
emptied before each mode's run of the three edits: the later edits may draft from the earlier
ones' answers in the same run (an agent's session), never from the same edit answered before.

    python bench/predicted_outputs.py
    python bench/predicted_outputs.py --model qwen2.5-coder-1.5b --rounds 3
    python bench/predicted_outputs.py --model qwen2.5-coder-1.5b --rounds 3 --speculative auto
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import uvloop
from common import provenance
from speculative import AGENT, FILE, forget_outputs

import deepinfer  # noqa: F401  (before torch: OpenMP's waits)
from deepinfer.config import Config, DiskCacheConfig, ModelConfig, SpeculativeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.environment import default_model_path, resolve_model
from deepinfer.request import SamplingParams
from deepinfer.scheduler.drafting import Drafter
from deepinfer.text.messages import ChatMessage

MODES = ("plain", "flags", "predicted", "answer")
"""`flags` (the proposer without a prediction) runs only with `--speculative`."""


async def one(
    engine: AsyncEngine, prompt: list[ChatMessage], max_tokens: int, prediction: str | None
) -> tuple[list[int], str, float, float, Usage]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids: list[int] = []
    text: list[str] = []
    first = last = 0.0
    usage: Usage | None = None
    async for out in engine.generate(prompt, params, prediction=prediction):
        now = time.perf_counter()
        first = first or now
        last = now
        ids.extend(out.token_ids)
        text.append(out.text)
        usage = out.usage
    assert usage is not None
    return ids, "".join(text), first, last, usage


def _prediction(mode: str, answer: str) -> str | None:
    return {"plain": None, "flags": None, "predicted": FILE, "answer": answer}[mode]


def set_mode(engine: AsyncEngine, drafter: Drafter, mode: str) -> None:
    """Plain decoding takes the drafter away (no proposer, no prediction); every other mode
    drafts with the engine's flags, its proposer's stores of earlier outputs emptied."""
    core = engine._core
    assert core is not None
    core.scheduler.drafter = None if mode == "plain" else drafter  # type: ignore[assignment]
    forget_outputs(drafter)


async def measure(ns: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    model = resolve_model(Path(ns.model))
    config = Config(
        model=ModelConfig(path=model),
        disk_cache=DiskCacheConfig(enabled=False),
        speculative=SpeculativeConfig(speculative=ns.speculative),
    )
    modes = MODES if ns.speculative != "none" else tuple(m for m in MODES if m != "flags")
    figures: dict[str, dict[str, list[float]]] = {
        m: {"single": [], "multi": [], "accepted": [], "rejected": []} for m in modes
    }
    async with AsyncEngine(config) as engine:
        assert engine._core is not None
        drafter = engine._core.scheduler.drafter
        assert drafter is not None
        set_mode(engine, drafter, "plain")
        answers = {}
        for i, prompt in enumerate(AGENT):
            await one(engine, prompt, ns.max_tokens, None)  # warm-up, the prompt's prefix cached
            ids, text, *_ = await one(engine, prompt, ns.max_tokens, None)  # from the cache
            answers[i] = (ids, text)
        for r in range(ns.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            decoded = {m: 0 for m in modes}
            seconds = {m: 0.0 for m in modes}
            for mode in order:
                set_mode(engine, drafter, mode)
                for i, prompt in enumerate(AGENT):
                    want, answer = answers[i]
                    ids, _, first, last, usage = await one(
                        engine, prompt, ns.max_tokens, _prediction(mode, answer)
                    )
                    if ids != want:
                        raise SystemExit(f"{mode}: edit {i} differs from plain decoding")
                    decoded[mode] += len(ids) - 1
                    seconds[mode] += last - first
                    figures[mode]["accepted"].append(usage.accepted_prediction_tokens)
                    figures[mode]["rejected"].append(usage.rejected_prediction_tokens)
            for mode in order:
                set_mode(engine, drafter, mode)
                figures[mode]["single"].append(decoded[mode] / seconds[mode])
                if not ns.streams:
                    continue
                prompts = [i % len(AGENT) for i in range(ns.streams)]
                start = time.perf_counter()
                runs = await asyncio.gather(
                    *(
                        one(engine, AGENT[i], ns.max_tokens, _prediction(mode, answers[i][1]))
                        for i in prompts
                    )
                )
                wall = time.perf_counter() - start
                figures[mode]["multi"].append(sum(len(run[0]) for run in runs) / wall)
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{m} "
                    + " / ".join(
                        f"{figures[m][k][-1]:.1f}" for k in ("single", "multi") if figures[m][k]
                    )
                    + " tok/s"
                    for m in modes
                ),
                flush=True,
            )
    return figures


def report(ns: argparse.Namespace, figures: dict[str, dict[str, list[float]]]) -> None:
    """The table; the columns of `--streams` only where they ran."""
    med = {m: {k: statistics.median(v) for k, v in f.items() if v} for m, f in figures.items()}
    print(f"\n### Predicted Outputs: `bench/predicted_outputs.py`\n\n{provenance()}\n")
    print(
        f"model {Path(ns.model).name}, --speculative {ns.speculative}, {ns.rounds} rounds, "
        f"max_tokens {ns.max_tokens}\n"
    )
    columns = ["mode", "1 stream tok/s", "x plain"]
    columns += [f"{ns.streams} streams tok/s", "x plain"] if ns.streams else []
    columns.append("accepted / rejected prediction tokens (median per request)")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for m in figures:
        cells = [m]
        for kind in ("single", "multi") if ns.streams else ("single",):
            ratio = statistics.median(
                a / b for a, b in zip(figures[m][kind], figures["plain"][kind], strict=True)
            )
            cells += [f"{med[m][kind]:.1f}", f"{ratio:.2f}x"]
        cells.append(f"{med[m]['accepted']:.0f} / {med[m]['rejected']:.0f}")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()), help="a GGUF file or a name")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--streams", type=int, default=8, help="0: single stream only")
    ap.add_argument(
        "--speculative",
        default="none",
        choices=("none", "ngram", "suffix", "auto"),
        help="the engine's proposer besides predictions (the default flags: none)",
    )
    ns = ap.parse_args()
    figures = uvloop.run(measure(ns))
    report(ns, figures)


if __name__ == "__main__":
    main()
