"""Prompt logprobs through the engine on the real SmolLM2, against transformers' logits.

Transformers loads the same GGUF; each prompt token's logprob must be `log_softmax` of its
logits at the position before. The prompts are long enough to be prefilled in several chunks,
and a prompt already in the prefix cache must still be scored from its first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from deepinfer.config import Config, SchedulerConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import GenerationOutput
from deepinfer.environment import default_model_path
from deepinfer.outputs import PromptLogprob
from deepinfer.request import SamplingParams
from tests.engine.conftest import real_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CHUNK_TOKENS = 16
"""Prefill chunk size: every prompt below spans several chunks."""
ATOL = 1e-4
"""On logprobs: float32 arithmetic and KV on both sides (measured: within 2.5e-5)."""
TEXTS = [
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus "
    "became the first emperor in 27 BC, after a long period of civil war. Over the following "
    "centuries the empire grew to cover the whole Mediterranean basin.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
    "Question: What is the boiling point of water at sea level, in degrees Celsius, and why "
    "does it change on a mountain?\nAnswer: 100 degrees; lower air pressure lowers it.",
]
MEASURED: dict[str, float] = {}
"""The largest |ours - transformers| seen (printed with -s)."""


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[torch.Tensor]]:
    """Token ids (transformers' tokenizer for the GGUF) and transformers' log_softmax(logits)."""
    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kwargs
    )
    model.eval()
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    with torch.no_grad():
        logprobs = [
            torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts
        ]
    return prompts, logprobs


def _config(colocated: bool) -> Config:
    base = real_config()
    return dataclasses.replace(
        base,
        cache=dataclasses.replace(base.cache, kv_dtype="float32"),  # float16 KV rounds by 1e-3
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=CHUNK_TOKENS),
        workers=WorkersConfig(colocated=colocated, prefill_max_batched_tokens=CHUNK_TOKENS),
    )


@pytest.fixture(scope="module", params=[False, True], ids=["disaggregated", "colocated"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(_config(request.param)) as engine:
        yield engine


async def _run(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> GenerationOutput:
    """The request's outputs merged: the prompt logprobs of the first, the last's usage."""
    outs = [out async for out in await engine.submit(ids, params)]
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == (1 if params.prompt_logprobs is not None else 0)
    return dataclasses.replace(outs[-1], prompt_logprobs=firsts[0] if firsts else None)


def _check(got: tuple[PromptLogprob, ...], prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """Entry i scores prompt token i + 1 from the logits at position i."""
    assert [e.token_id for e in got] == prompt[1:]
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    ours = torch.tensor([e.logprob for e in got])
    diff = (ours - want).abs().max().item()
    MEASURED["token"] = max(MEASURED.get("token", 0.0), diff)
    assert diff < ATOL
    for i, e in enumerate(got):
        row = ref[i]
        assert 1 + (row > want[i] + ATOL).sum().item() <= e.rank
        assert e.rank <= 1 + (row > want[i] - ATOL).sum().item()
        assert len(e.top_logprobs) == k
        top_ids = [t for t, _ in e.top_logprobs]
        top_lps = torch.tensor([lp for _, lp in e.top_logprobs])
        if k:
            assert (top_lps - row[top_ids]).abs().max().item() < ATOL
            assert top_lps[-1].item() >= row.topk(k).values[-1].item() - ATOL
            assert sorted(top_lps.tolist(), reverse=True) == top_lps.tolist()
            top_diff = (top_lps - row[top_ids]).abs().max().item()
            MEASURED["top"] = max(MEASURED.get("top", 0.0), top_diff)


async def test_prompt_logprobs_match_transformers(engine: AsyncEngine, reference: Any) -> None:
    prompts, logprobs = reference
    assert all(len(p) > 2 * CHUNK_TOKENS for p in prompts), [len(p) for p in prompts]
    for k, prompt, ref in zip((0, 1, 5), prompts, logprobs, strict=True):
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k)
        out = await _run(engine, prompt, params)
        assert out.prompt_logprobs is not None
        _check(out.prompt_logprobs, prompt, ref, k)
    print(f"max |prompt logprob - transformers|: {MEASURED}")


async def test_requests_in_one_batch_keep_their_own(engine: AsyncEngine, reference: Any) -> None:
    """Prompts scored together (and one that asks for nothing beside them) get what each
    would alone."""
    prompts, logprobs = reference
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k) for k in (2, 0)]
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    outs = await asyncio.gather(
        _run(engine, prompts[0], params[0]),
        _run(engine, prompts[1], plain),
        _run(engine, prompts[2], params[1]),
    )
    assert outs[1].prompt_logprobs is None
    _check(outs[0].prompt_logprobs or (), prompts[0], logprobs[0], 2)
    _check(outs[2].prompt_logprobs or (), prompts[2], logprobs[2], 0)


async def test_a_cached_prompt_is_scored_whole(engine: AsyncEngine, reference: Any) -> None:
    """The prompt's blocks are in the prefix cache from a plain request: the scoring request
    computes them all again (no hit), and a plain request after it still hits them."""
    prompts, logprobs = reference
    prompt = prompts[0]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    await _run(engine, prompt, plain)
    again = await _run(engine, prompt, plain)
    assert again.usage.cached_tokens >= len(prompt) - 16
    scored = await _run(
        engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    )
    assert scored.usage.cached_tokens == 0
    _check(scored.prompt_logprobs or (), prompt, logprobs[0], 1)
    after = await _run(engine, prompt, plain)
    assert after.usage.cached_tokens >= len(prompt) - 16
    engine.check_integrity()


async def test_one_token_prompt_has_no_entries(engine: AsyncEngine, reference: Any) -> None:
    out = await _run(engine, [504], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert out.prompt_logprobs == ()
