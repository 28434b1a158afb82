"""Speculative decoding against plain decoding, engine only (the embedding API, no HTTP), on
SmolLM2 with greedy requests (or seeded sampled ones: `--temperature`), five workloads:

- agent: a tool-using session's turn that quotes and edits a file from its context (the model
  rewrites a ~30-line file with one change);
- trace: a tool loop replayed (run the tests, read the file, write it back fixed, run the
  tests again): four turns of one session, each the session up to a tool's result;
- code: completing a Python module from its first functions;
- chat: open questions (serve.py's kind of prompt);
- mixed: all nine prompts of the three, run only with several streams.

For each proposer, one engine; in it, three modes: `plain` (the scheduler's drafter taken away:
plain decoding), `gate` (the default: the confidence gate on) and `all` (the gate off: every
draft verified). Each round measures every workload one request at a time (single stream:
decode tokens/s from the first token to the last, the three modes back to back, in an order
rotating from round to round) and then 8 and 32 at once: streams kept busy (each sends its next
request as soon as its last ended, the first ones staggered: `engine_load.closed_loop`) while
the modes take turns every second, each decode step counted for the mode it was planned in
(`alternating`: the machine drifts by 5-10% over tens of seconds, more than the effects
measured), three windows long. Drafted and accepted tokens and the mean accepted run are
counted by mode. Ratios are each measurement's against the plain mode's beside it, and the
table gives their medians over the rounds. Every prompt is in the prefix
cache before the first measured run, so every run of a prompt starts from the same cached
prefix (with int8 activations, a prefix computed in the same step and one read from the cache
can decode differently), and the single-stream outputs of every mode are checked equal to
plain decoding's, token for token.

    python bench/speculative.py
    python bench/speculative.py --proposers ngram,suffix,auto --streams 8,32
    python bench/speculative.py --proposers ngram,suffix,auto --streams "" --temperature 0.7
    python bench/speculative.py --proposers ngram,layers,draft-model --rounds 3 --streams 8,32
    python bench/speculative.py --model qwen2.5-coder-1.5b --proposers ngram,suffix --streams ""

Suffix decoding's stores of earlier outputs are emptied before each measurement (the bench
repeats its prompts; their earlier outputs would draft whole answers): single stream, a
workload's own earlier answers still draft for its later prompts (the trace's turns); with
several streams the store fills within the run, where the same prompts recur by design.
`--temperature` above 0 makes every request sampled and seeded: the same tokens in every mode.
`--tool-grammar` gives every request the grammar a request declaring the trace's three tools gets
under `tool_choice: auto` (`api/tools/grammar.py`: text, or calls once `<tool_call>` is
written), plain decoding included: what speculation gains under a grammar, each verified
position masked.

`draft-model` drafts with `--draft-model PATH`; without it, with SmolLM2's first 8 layers
written as a GGUF of their own (`bench/truncated_draft.py`): no smaller model with SmolLM2's
vocabulary exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import uvloop
from alternating import ModeTally, alternating
from common import provenance
from engine_load import window_seconds
from truncated_draft import truncate

import deepinfer  # noqa: F401  (before torch: OpenMP's waits)
from deepinfer.api.tools.grammar import answer_constraint
from deepinfer.api.tools.plan import ToolPlan, ToolSchema
from deepinfer.config import Config, DiskCacheConfig, ModelConfig, SpeculativeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.environment import default_model_path, resolve_model
from deepinfer.request import SamplingParams
from deepinfer.runner.worker_draft import DRAFT_CONFIDENCE_MIN
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.speculative import SpeculativeCounts
from deepinfer.scheduler.suffix import SuffixProposer, TenantOutputs
from deepinfer.text.messages import ChatMessage

FILE = '''import json
from pathlib import Path


def load_config(path):
    """Read a JSON config file."""
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    """Write a config back as JSON."""
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def merge(base, override):
    """A copy of base with override's keys on top."""
    out = dict(base)
    for key, value in override.items():
        out[key] = value
    return out


def config_files(folder):
    """Every JSON file in a folder."""
    return sorted(Path(folder).glob("*.json"))
'''

AGENT = [
    [
        ChatMessage(
            "system", "You are a coding agent. You edit files and answer with the whole file."
        ),
        ChatMessage("user", f"This is config.py:\n```python\n{FILE}```\n{task}"),
    ]
    for task in (
        "Rename the function merge to merge_configs and output the whole file.",
        "Add a docstring line 'Config helpers.' at the top and output the whole file.",
        "Change indent=2 to indent=4 and output the whole file.",
    )
]
CODE = [
    [
        ChatMessage(
            "user", f"Continue this module with two more helper functions:\n```python\n{FILE[:420]}"
        )
    ],
    [ChatMessage("user", "Write a Python class Stack with push, pop, peek and is_empty methods.")],
    [ChatMessage("user", "Write a Python function that parses 'key=value' lines into a dict.")],
]
CHAT = [
    [ChatMessage("user", "Write a short paragraph about the ocean, then list 4 facts about rain.")],
    [ChatMessage("user", "What makes a good cup of tea? Answer in a few sentences.")],
    [ChatMessage("user", "Describe a lighthouse at night for a children's story.")],
]
FIXED = FILE.replace("out[key] = value", "if value is not None:\n            out[key] = value")


def _trace() -> list[list[ChatMessage]]:
    """A tool loop replayed: the agent runs the tests, reads the file, writes it back with a
    fix, runs the tests again; each prompt is the session up to a tool's result
    (the earlier actions as recorded), the next action the model's own."""
    task = (
        "You are a coding agent. Act with one tool call per turn: run_tests(), "
        "read_file(path), or write_file(path) followed by the whole file in a python block."
    )
    failing = (
        "FAILED test_config.py::test_merge_skips_none - AssertionError: "
        "assert {'a': None} == {'a': 1}\n1 failed, 4 passed"
    )
    steps = [
        ("run_tests()", failing),
        ('read_file("config.py")', FILE),
        (f'write_file("config.py")\n```python\n{FIXED}```', "written"),
        ("run_tests()", "5 passed"),
    ]
    session = [ChatMessage("system", task), ChatMessage("user", "Make test_merge pass.")]
    prompts = []
    for action, result in steps:
        session = [*session, ChatMessage("assistant", action), ChatMessage("user", result)]
        prompts.append(session)
    return prompts


TRACE = _trace()
TRACE_TOOLS = tuple(
    ToolSchema(name, json.dumps({"type": "object", "properties": props}), f"tools[{k}]")
    for k, (name, props) in enumerate([
        ("run_tests", {}),
        ("read_file", {"path": {"type": "string"}}),
        ("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    ])
)  # fmt: skip
"""The trace's tools, declared (`--tool-grammar`)."""
WORKLOADS = {
    "agent": AGENT,
    "trace": TRACE,
    "code": CODE,
    "chat": CHAT,
    "mixed": AGENT + CODE + CHAT,
}
"""`mixed` runs only with several streams: every prompt of the others, in turn."""


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    """The single-stream outputs, in prompt order (checked against plain decoding)."""
    single_tok_s: float
    multi_tok_s: dict[int, float]
    """Aggregate tokens/s by number of streams."""


Counts = tuple[int, int, int]
"""Drafted, accepted, and request-steps that verified drafts."""


async def one(
    engine: AsyncEngine, prompt: list[ChatMessage], params: SamplingParams
) -> tuple[list[int], float, float]:
    ids: list[int] = []
    first = last = 0.0
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        first = first or now
        last = now
        ids.extend(out.token_ids)
    return ids, first, last


async def single_stream(
    engine: AsyncEngine, prompts: list, params: SamplingParams
) -> tuple[list, float]:
    tokens, decode_s, decoded = [], 0.0, 0
    for prompt in prompts:
        ids, first, last = await one(engine, prompt, params)
        tokens.append(ids)
        decode_s += last - first
        decoded += len(ids) - 1
    return tokens, decoded / decode_s


async def many_streams(
    engine: AsyncEngine,
    drafter: Drafter,
    prompts: list,
    params: SamplingParams,
    streams: int,
    flip: bool,
) -> dict[str, tuple[float, Counts]]:
    """Every mode's aggregate tokens/s over `streams` clients kept busy, and its counts, from two
    runs of two modes taking turns every second (`alternating`; `flip`: the other one first),
    each two `closed_loop` windows long: plain with the gate, then the gate with all. A mode that
    verifies every draft leaves work to the mode after it (at 32 streams, the next turn's steps
    took ~10% longer: more requests ended in its turn, and their successors' prefill falls in
    the next), so it is kept out of the comparison of plain with the gate; its tokens/s are put
    on the first run's scale (the gate's there times all's ratio to the gate in the second)."""
    seconds = 2 * window_seconds(streams)
    pairs = (("plain", "gate"), ("gate", "all"))
    first, second = [
        await alternating(
            engine, drafter, prompts, params, streams, p[::-1] if flip else p, seconds
        )
        for p in pairs
    ]
    plain, gate, gate_2, every = first["plain"], first["gate"], second["gate"], second["all"]
    return {
        "plain": (_rate(plain), _counts(plain)),
        "gate": (_rate(gate), _add(_counts(gate), _counts(gate_2))),
        "all": (_rate(gate) * _rate(every) / max(_rate(gate_2), 1e-9), _counts(every)),
    }


def _rate(t: ModeTally) -> float:
    return t.tokens / max(t.seconds, 1e-9)


def _counts(t: ModeTally) -> Counts:
    return (t.drafted, t.accepted, t.verified)


def _delta(before: SpeculativeCounts, after: SpeculativeCounts) -> Counts:
    return (
        after.num_drafted - before.num_drafted,
        after.num_accepted - before.num_accepted,
        after.num_verified - before.num_verified,
    )


def _add(a: Counts, b: Counts) -> Counts:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


MODES = ("plain", "gate", "all")


def forget_outputs(drafter: Drafter) -> None:
    """Empty suffix decoding's stores of earlier outputs: every measurement repeats prompts the
    engine has answered before (in another mode, or round), and their outputs would draft the
    whole answer; a workload's own earlier outputs (the trace's turns) still do."""
    proposer = drafter.proposer
    for p in getattr(proposer, "proposers", (proposer,)):
        if isinstance(p, SuffixProposer):
            p.outputs = TenantOutputs()


def set_mode(engine: AsyncEngine, drafter: object, mode: str) -> None:
    """Between runs (nothing in flight): plain decoding (no drafter), or drafting with the gate
    on or off (the worker drafter's confidence cut goes with the gate, as at start-up)."""
    core = engine._core
    assert core is not None
    core.scheduler.drafter = None if mode == "plain" else drafter  # type: ignore[assignment]
    if mode == "plain":
        return
    drafter.gate.enabled = mode == "gate"  # type: ignore[attr-defined]
    worker = core.decode_runner.drafter
    if worker is not None:
        worker.min_confidence = DRAFT_CONFIDENCE_MIN if mode == "gate" else 0.0


async def run_round(
    engine: AsyncEngine,
    drafter: Drafter,
    order: tuple[str, ...],
    params: SamplingParams,
    streams: list[int],
) -> dict[str, tuple[dict[str, Run], dict[str, Counts]]]:
    """Every workload single-stream (the mixed one only with several streams), the modes back to
    back in `order`, then at each stream count, the modes taking turns within one run. Each
    mode's speculative counts by workload."""
    runs = {m: {w: Run([], 0.0, {}) for w in WORKLOADS} for m in order}
    counts: dict[str, dict[str, Counts]] = {m: {w: (0, 0, 0) for w in WORKLOADS} for m in order}
    for workload, prompts in WORKLOADS.items():
        if workload != "mixed":
            for mode in order:
                set_mode(engine, drafter, mode)
                forget_outputs(drafter)
                before = engine.stats().speculative
                tokens, tok_s = await single_stream(engine, prompts, params)
                after = engine.stats().speculative
                counts[mode][workload] = _add(counts[mode][workload], _delta(before, after))
                runs[mode][workload].tokens = tokens
                runs[mode][workload].single_tok_s = tok_s
        for n in streams:
            flip = order[0] != "plain"
            forget_outputs(drafter)
            measured = await many_streams(engine, drafter, prompts, params, n, flip)
            for mode, (tok_s, c) in measured.items():
                runs[mode][workload].multi_tok_s[n] = tok_s
                counts[mode][workload] = _add(counts[mode][workload], c)
    return {m: (runs[m], counts[m]) for m in order}


async def run_proposer(
    model: Path,
    proposer: str,
    draft_model: Path | None,
    params: SamplingParams,
    streams: list[int],
    rounds: int,
) -> list[dict[str, tuple[dict[str, Run], dict[str, Counts]]]]:
    """One engine with the proposer; each round every mode, in a rotating order."""
    spec = SpeculativeConfig(
        speculative=proposer,  # type: ignore[arg-type]
        draft_model=str(draft_model) if proposer == "draft-model" else None,
    )
    config = Config(
        model=ModelConfig(path=model), disk_cache=DiskCacheConfig(enabled=False), speculative=spec
    )
    out = []
    async with AsyncEngine(config) as engine:
        assert engine._core is not None
        drafter = engine._core.scheduler.drafter
        assert drafter is not None
        warm = [p for w, prompts in WORKLOADS.items() if w != "mixed" for p in prompts]
        for prompt in warm:  # warm-up, and every prompt in the prefix cache
            await one(engine, prompt, dataclasses.replace(params, max_tokens=1))
        for r in range(rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            out.append(await run_round(engine, drafter, order, params, streams))
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(default_model_path()), help="a GGUF file or a name")
    ap.add_argument("--proposers", default="ngram,layers,draft-model")
    ap.add_argument("--draft-model", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--streams",
        default="8,32",
        help="stream counts, comma-separated (empty: single stream only)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="every mode once per round")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="above 0: sampled requests, each seeded (the same tokens in every mode)",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="the workloads measured, comma-separated (all by default)",
    )
    ap.add_argument(
        "--tool-grammar",
        action="store_true",
        help="every request under the `auto` grammar of three declared tools",
    )
    ns = ap.parse_args()
    unknown = set(ns.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    for name in set(WORKLOADS) - set(ns.workloads.split(",")):
        del WORKLOADS[name]
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        seed=7 if ns.temperature > 0 else None,
    )
    if ns.tool_grammar:
        params = answer_constraint(params, ToolPlan(schemas=TRACE_TOOLS), None)
    started = provenance()  # the code that runs is the tree at the start
    model = resolve_model(Path(ns.model))
    proposers = ns.proposers.split(",")
    streams = [int(n) for n in ns.streams.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        draft = ns.draft_model
        if draft is None and "draft-model" in proposers:
            draft = Path(tmp) / "smollm2-first-8-layers.gguf"
            truncate(model, draft, 8)
        results = {
            p: uvloop.run(run_proposer(model, p, draft, params, streams, ns.rounds))
            for p in proposers
        }
    print(started)
    print()
    multi_cols = " | ".join(f"{n} streams tok/s | vs plain" for n in streams)
    print(
        f"| workload | proposer | mode | 1 stream tok/s | vs plain | {multi_cols} | drafted "
        "| accepted | mean accepted run | same tokens |"
    )
    print("|---|---|---|---:|---:|" + "---:|---:|" * len(streams) + "---:|---:|---:|---|")
    for workload in WORKLOADS:
        for p in proposers:
            for mode in MODES:
                print(_row(workload, p, mode, results[p], streams))
    print()
    print(
        f"Ratios are medians over {ns.rounds} rounds of each round's ratio to the plain mode "
        "of the same engine."
    )
    print()
    print("Each round's ratio of the gate to plain (single stream, then each stream count):")
    for workload in WORKLOADS:
        for p in proposers:
            print(f"- {workload}, {p}: {_spread(workload, results[p], streams)}")
    print()
    print("The gate over all (median over rounds of each round's ratio), by stream count:")
    for workload in WORKLOADS:
        for p in proposers:
            cells = [
                f"{n}: {_median([r['gate'][0][workload].multi_tok_s[n] / r['all'][0][workload].multi_tok_s[n] for r in results[p]]):.2f}x"
                for n in streams
            ]
            print(f"- {workload}, {p}: " + "; ".join(cells))


def _spread(workload: str, rounds: list, streams: list[int]) -> str:
    """The gate's ratio to plain in every round, by measurement."""
    gate = [r["gate"][0][workload] for r in rounds]
    plain = [r["plain"][0][workload] for r in rounds]
    cells = []
    if workload != "mixed":
        ratios = [g.single_tok_s / q.single_tok_s for g, q in zip(gate, plain, strict=True)]
        cells.append("1: " + " ".join(f"{x:.2f}" for x in ratios))
    for n in streams:
        ratios = [g.multi_tok_s[n] / q.multi_tok_s[n] for g, q in zip(gate, plain, strict=True)]
        cells.append(f"{n}: " + " ".join(f"{x:.2f}" for x in ratios))
    return "; ".join(cells)


def _row(workload: str, proposer: str, mode: str, rounds: list, streams: list[int]) -> str:
    runs = [r[mode][0][workload] for r in rounds]
    plains = [r["plain"][0][workload] for r in rounds]
    drafted, accepted, verified = (sum(r[mode][1][workload][i] for r in rounds) for i in range(3))
    same = all(run.tokens == plain.tokens for run, plain in zip(runs, plains, strict=True))
    cells = [f"| {workload} | {proposer} | {mode} "]
    if workload == "mixed":
        cells.append("| - | - ")
    else:
        single = _median([run.single_tok_s for run in runs])
        ratio = _median(
            [run.single_tok_s / p.single_tok_s for run, p in zip(runs, plains, strict=True)]
        )
        cells.append(f"| {single:.1f} | {ratio:.2f}x ")
    for n in streams:
        tok_s = _median([run.multi_tok_s[n] for run in runs])
        ratio = _median(
            [run.multi_tok_s[n] / p.multi_tok_s[n] for run, p in zip(runs, plains, strict=True)]
        )
        cells.append(f"| {tok_s:.1f} | {ratio:.2f}x ")
    mean_run = f"{accepted / verified:.2f}" if verified else "-"
    cells.append(f"| {drafted} | {accepted} | {mean_run} | {'yes' if same else 'NO'} |")
    return "".join(cells)


if __name__ == "__main__":
    main()
