"""Grammar libraries for structured output, compared on SmolLM2's vocabulary (49152 tokens):
llguidance and xgrammar, on the test corpus of JSON schemas (tests/sampling/structured/schema_corpus.py).

For each library: compile time per schema (p50, p99; every schema compiled fresh, no cache),
and the time to fill the next-token bitmask along random walks through each grammar (a random
allowed token each step), at 1 stream and at 32 streams per step (llguidance's thread-pool
fill, xgrammar's batch fill; both on every core). Prints a Markdown table.

    python bench/structured_libs.py [--schemas 320] [--steps 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np
import torch
import xgrammar as xgr

from deepinfer.environment import default_model_path
from deepinfer.sampling.grammar import llg_tokenizer
from deepinfer.sampling.vocabulary import GrammarVocabulary, vocabulary_from
from deepinfer.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def load_corpus(count: int) -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "schema_corpus", ROOT / "tests/sampling/structured/schema_corpus.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [json.dumps(s) for s in module.schema_corpus(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance " + llg.get_version() if hasattr(llg, "get_version") else "llguidance"

    def __init__(self, vocab: GrammarVocabulary) -> None:
        self.tokenizer = llg_tokenizer(vocab)
        self.executor = llg.LLExecutor()

    def compile(self, schema: str) -> Any:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        if len(matchers) == 1:
            llg_np.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            llg_np.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matcher: Any, token_id: int) -> None:
        assert matcher.consume_token(token_id), matcher.get_error()

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped() or matcher.is_accepting())


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: GrammarVocabulary) -> None:
        info = xgr.TokenizerInfo(
            list(vocab.token_bytes),
            xgr.VocabType.RAW,
            vocab_size=vocab.size,
            stop_token_ids=[vocab.eos_token_id],
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        tensor = torch.from_numpy(bitmask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(tensor, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, tensor)

    def accept(self, matcher: Any, token_id: int) -> None:
        assert matcher.accept_token(token_id)

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated() or matcher.is_completed())


def time_compiles(lib: Any, schemas: list[str]) -> tuple[list[Any], list[float]]:
    compiled, times = [], []
    for schema in schemas:
        start = time.perf_counter()
        compiled.append(lib.compile(schema))
        times.append(time.perf_counter() - start)
    return compiled, times


def time_masks(
    lib: Any, compiled: list[Any], streams: int, steps: int, vocab_size: int, eos: int
) -> list[float]:
    """Seconds per fill of `streams` rows, along random walks of at most `steps` tokens."""
    rng = random.Random(0)
    times: list[float] = []
    for first in range(0, len(compiled) - streams + 1, streams):
        matchers = [lib.matcher(c) for c in compiled[first : first + streams]]
        bitmask = np.full((streams, (vocab_size + 31) // 32), -1, dtype=np.int32)
        for _ in range(steps):
            start = time.perf_counter()
            lib.fill(matchers, bitmask)
            times.append(time.perf_counter() - start)
            live = False
            for i, m in enumerate(matchers):
                ids = allowed_ids(bitmask[i], vocab_size)
                ids = ids[ids != eos]
                if len(ids) and not lib.done(m):
                    lib.accept(m, int(rng.choice(list(ids))))
                    live = True
            if not live:
                break
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schemas", type=int, default=320)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    reader = gguf.GGUFReader(str(default_model_path()))
    tokenizer = Tokenizer.from_gguf(reader)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    vocab = vocabulary_from(tokenizer, eos)
    schemas = load_corpus(args.schemas)
    print(
        "| library | schemas | compile p50 ms | compile p99 ms | mask 1 stream p50 us | "
        "mask 1 stream p99 us | mask 32 streams p50 us | mask 32 streams p99 us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    factories: list[Callable[[GrammarVocabulary], Any]] = [Llguidance, Xgrammar]
    for factory in factories:
        start = time.perf_counter()
        lib = factory(vocab)
        setup_s = time.perf_counter() - start
        compiled, compile_s = time_compiles(lib, schemas)
        one = time_masks(lib, compiled, 1, args.steps, vocab.size, eos)
        many = time_masks(lib, compiled, 32, args.steps, vocab.size, eos)
        ms, us = 1e3, 1e6
        print(
            f"| {lib.name} (tokenizer set-up {setup_s:.2f} s) | {len(schemas)} | "
            f"{statistics.median(compile_s) * ms:.2f} | {percentile(compile_s, 0.99) * ms:.2f} | "
            f"{statistics.median(one) * us:.0f} | {percentile(one, 0.99) * us:.0f} | "
            f"{statistics.median(many) * us:.0f} | {percentile(many, 0.99) * us:.0f} |"
        )


if __name__ == "__main__":
    main()
