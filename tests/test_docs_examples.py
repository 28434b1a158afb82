"""The embedding example of docs/usage.md, extracted from the page and run as written on the
tiny model.

Only the engine's `Config()` is replaced (by a config for `tiny_llama_dir`), and the engine class
by a subclass that records what the example asks for. What the example prints must be the text
of the tokens an offline `EngineCore` decodes greedily for the same prompt and parameters.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.engine.types import GenerationOutput
from deepinfer.request import Request, SamplingParams
from deepinfer.text.recipe import ChatMessage

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/usage.md"
ENGINE_CALL = "AsyncEngine(Config())"


def _embedding_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / PAGE).read_text(), flags=re.S)
    (example,) = [b for b in blocks if "async with AsyncEngine(" in b]
    return example


def _tiny_config(model_dir: Path) -> Config:
    return Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )


class _RecordingEngine(AsyncEngine):
    """The engine itself; `generate` also keeps its prompt and parameters."""

    calls: ClassVar[list[tuple[list[ChatMessage], SamplingParams]]] = []

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, **kwargs: Any
    ) -> AsyncIterator[GenerationOutput]:
        assert params is not None, "the example passes its SamplingParams"
        self.calls.append((list(prompt), params))
        async for out in super().generate(prompt, params, **kwargs):
            yield out


def _offline_answer(config: Config, messages: list[ChatMessage], params: SamplingParams) -> str:
    """The greedy answer through the synchronous core (no event loop, no streams), decoded whole."""
    core = EngineCore(config)
    try:
        request = Request(
            request_id="reference",
            prompt_token_ids=core.recipe.encode(messages),
            sampling=params,
            eos_token_ids=core.recipe.end_of_turn_ids,
        )
        core.add_request(request)
        while not request.is_finished:
            core.step()
        ids = [t for t in request.output_token_ids if t not in request.stop_token_ids]
        return core.tokenizer.decode(ids)
    finally:
        core.close()


def test_embedding_example_prints_the_engines_answer(tiny_llama_dir: Path) -> None:
    example = _embedding_example()
    assert example.count(ENGINE_CALL) == 1, f"the example no longer builds {ENGINE_CALL}"
    code = example.replace(ENGINE_CALL, "_RecordingEngine(TEST_CONFIG)")
    config = _tiny_config(tiny_llama_dir)
    _RecordingEngine.calls = []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(
            compile(code, PAGE, "exec"),
            {"__name__": "__main__", "_RecordingEngine": _RecordingEngine, "TEST_CONFIG": config},
        )
    ((messages, params),) = _RecordingEngine.calls
    assert params.temperature == 0.0, "the reference is greedy; so must the example be"
    answer = _offline_answer(config, messages, params)
    assert answer.strip(), "the tiny model answered nothing: the comparison would be empty"
    assert printed.getvalue() == answer + "\n"
