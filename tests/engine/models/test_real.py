"""The engine on the real SmolLM2 model: answers, batching invariance, stops, aborts, seeds."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.errors import ContextLengthError
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.recipe import ChatMessage

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


async def _complete(engine: AsyncEngine, prompt, params=GREEDY) -> tuple[str, list[int], object]:  # type: ignore[no-untyped-def]
    text, ids, last = [], [], None
    async for out in engine.generate(prompt, params):
        text.append(out.text)
        ids.extend(out.token_ids)
        last = out
    return "".join(text), ids, last


async def _settle(engine: AsyncEngine) -> None:
    for _ in range(200):
        if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
            return
        await asyncio.sleep(0.01)


async def test_capital_of_france(real_engine: AsyncEngine) -> None:
    text, _, last = await _complete(
        real_engine, [ChatMessage("user", "What is the capital of France?")]
    )
    assert "Paris" in text
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_batch_of_16_matches_each_alone(real_engine: AsyncEngine) -> None:
    prompts = [
        [ChatMessage("user", f"Count from {i} to {i + 3 * (i % 4) + 2}, then name a fruit.")]
        if i % 2
        else f"Story {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i)
        for i in range(16)
    ]
    alone = [(await _complete(real_engine, p))[1] for p in prompts]
    together = await asyncio.gather(*(_complete(real_engine, p) for p in prompts))
    assert [ids for _, ids, _ in together] == alone
    await _settle(real_engine)
    real_engine.check_integrity()
    assert real_engine.stats().num_blocks_used == 0


async def test_repeated_prompt_is_served_from_cache(real_engine: AsyncEngine) -> None:
    prompt = [ChatMessage("user", "Describe the sea in three sentences. " * 6)]
    first = (await _complete(real_engine, prompt))[2]
    second = (await _complete(real_engine, prompt))[2]
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.usage.cached_tokens % 16 == 0


async def test_stop_string_never_leaks(real_engine: AsyncEngine) -> None:
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    full, _, _ = await _complete(real_engine, prompt, SamplingParams(max_tokens=20, temperature=0))
    assert " 10" in full
    text, _, last = await _complete(
        real_engine, prompt, SamplingParams(max_tokens=20, temperature=0, stop=(" 10",))
    )
    assert text == full[: full.index(" 10")]
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == " 10"


async def test_same_seed_same_output(real_engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    a = await _complete(real_engine, "My favourite animal is", params)
    b = await _complete(real_engine, "My favourite animal is", params)
    c = await _complete(
        real_engine,
        "My favourite animal is",
        SamplingParams(max_tokens=16, temperature=1.0, seed=99),
    )
    assert a[1] == b[1]
    assert a[1] != c[1]


async def test_abort_by_closing_the_iterator_frees_blocks(real_engine: AsyncEngine) -> None:
    gen = real_engine.generate(
        "Tell me a long story about dragons.", SamplingParams(max_tokens=200)
    )
    async for _ in gen:
        break
    await gen.aclose()
    await _settle(real_engine)
    assert real_engine.stats().num_blocks_used == 0
    real_engine.check_integrity()


async def test_abort_by_id(real_engine: AsyncEngine) -> None:
    stream = await real_engine.submit(
        "Write an essay about rivers.", SamplingParams(max_tokens=200)
    )
    assert real_engine.abort(stream.request_id)
    outs = [out async for out in stream]
    assert outs[-1].finish_reason is FinishReason.ABORT
    await _settle(real_engine)
    assert real_engine.stats().num_blocks_used == 0


async def test_prompt_longer_than_context_is_refused(real_engine: AsyncEngine) -> None:
    with pytest.raises(ContextLengthError, match="context"):
        await real_engine.submit(list(range(10, 10 + real_engine.max_model_len)), GREEDY)


def test_cli_generate_answers_paris() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "generate",
            "--chat",
            "--max-tokens",
            "24",
            "--matmul-activations",  # transformers' numerics: its answer names Paris
            "float32",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_reports_a_missing_model_clearly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "generate",
            "hi",
            "--model",
            str(tmp_path / "nope.gguf"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "nope.gguf" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_chat_streams_a_conversation() -> None:
    proc = subprocess.run(
        # transformers' numerics (float32 activations): its answer names Paris
        [sys.executable, "-m", "deepinfer.cli", "chat", "--max-tokens", "24",
         "--matmul-activations", "float32"],
        input="What is the capital of France?\n/exit\n",
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
