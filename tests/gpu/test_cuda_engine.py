"""The engine on a CUDA device, with the real SmolLM2 (skipped where there is none).

The same code as on CPU, with what only CUDA has: Triton kernels compiled for the GPU, each
worker's steps on its own CUDA stream, KV written on the prefill worker's stream and read on the
decode worker's. Greedy tokens are compared across backends and devices; tests/gpu/README.md says
how the GPU run is made (kernel, model and engine tests run there too, on CUDA).
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.request import Request, SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.recipe import ChatMessage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [
    "The history of the Roman Empire spans more than a thousand years. It began when",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]


def _config(
    device: str, backend: str = "auto", dtype: str = "float32", graphs: str = "auto"
) -> Config:
    return Config(
        model=ModelConfig(dtype=dtype, quantized_matmul="off"),  # type: ignore[arg-type]
        cache=CacheConfig(num_blocks=256, block_size=16, kv_dtype="float32"),  # exact on CPU too
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=8),
        runtime=RuntimeConfig(device=device, attention_backend=backend, cuda_graphs=graphs),  # type: ignore[arg-type]
    )


def _greedy(config: Config, num_tokens: int = 24) -> list[list[int]]:
    return _greedy_core(config, num_tokens)[0]


def _greedy_core(config: Config, num_tokens: int = 24) -> tuple[list[list[int]], EngineCore]:
    core = EngineCore(config)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        ids = core.tokenizer.encode_with_specials(text)
        core.add_request(Request(f"r{i}", ids, params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_work:
        for delta in core.step():
            outputs[delta.request_id].extend(delta.token_ids)
        core.check_integrity()
    return [outputs[f"r{i}"] for i in range(len(PROMPTS))], core


def test_triton_and_torch_attention_agree_with_the_cpu() -> None:
    """float32 everywhere: Triton on CUDA (decode from CUDA graphs), torch on CUDA and torch on
    CPU (both eager) pick the same tokens."""
    triton = _greedy(_config("cuda", "triton"))
    assert triton == _greedy(_config("cuda", "torch"))
    assert triton == _greedy(_config("cpu", "torch"))


def test_decode_graphs_replay_the_eager_tokens() -> None:
    graphed, core = _greedy_core(_config("cuda", "triton", graphs="on"))
    assert core.info.decode_graph_sizes == (1, 2, 4, 8)
    graphs = core.runner.graphs
    assert graphs is not None and graphs.decode is not None and graphs.decode.num_replays >= 20
    assert graphs.prefill is not None and graphs.prefill.num_replays >= 1
    eager, core = _greedy_core(_config("cuda", "triton", graphs="off"))
    assert core.runner.graphs is not None and core.runner.graphs.num_replays == 0
    assert core.info.decode_graph_sizes == () and core.info.prefill_graph_buckets == ()
    assert graphed == eager


def test_prefill_graphs_replay_the_eager_tokens() -> None:
    """Prompts of ~900 tokens prefilled in steps of at most 256 (full buckets, then a padded
    last chunk beside short prompts), and again from the prefix cache: the eager tokens."""
    long_prompts = [PROMPTS[0] * 12, PROMPTS[1] * 12]

    def run(graphs: str) -> tuple[list[list[int]], EngineCore]:
        config = _config("cuda", "triton", graphs=graphs)
        config = config.replace(
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
        )
        core = EngineCore(config)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        texts = [*long_prompts, *PROMPTS, long_prompts[0] + " and then"]
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(texts))}
        for i, text in enumerate(texts):
            core.add_request(Request(f"r{i}", core.tokenizer.encode_with_specials(text), params))
            if i == len(texts) - 2:  # the last one after the others: a cached prefix
                while core.has_work:
                    for delta in core.step():
                        outputs[delta.request_id].extend(delta.token_ids)
        while core.has_work:
            for delta in core.step():
                outputs[delta.request_id].extend(delta.token_ids)
            core.check_integrity()
        return [outputs[f"r{i}"] for i in range(len(texts))], core

    graphed, core = run("on")
    assert core.info.prefill_graph_buckets == (16, 32, 64, 128, 256)
    prefill = core.runner.graphs.prefill if core.runner.graphs is not None else None
    assert prefill is not None and prefill.num_replays >= 8
    eager, _ = run("off")
    assert graphed == eager


async def test_bfloat16_default_answers_and_workers_use_their_own_streams() -> None:
    """CUDA's defaults (bfloat16, Triton, disaggregated): the answer, each worker on its own
    non-default stream, both workers stepping, no block leaked."""
    config = Config(disk_cache=DiskCacheConfig(enabled=False), runtime=RuntimeConfig(device="cuda"))
    async with AsyncEngine(config) as engine:
        assert engine.info.device.type == "cuda"
        assert engine.info.attention_backend == "triton"
        assert engine.info.decode_graph_sizes[-1] == engine.config.scheduler.max_num_seqs
        assert engine.info.prefill_graph_buckets[-1] == 2048  # the step's token budget
        streams = [w._stream for w in engine._workers]
        assert len(streams) == 2 and None not in streams
        assert streams[0] != streams[1]
        assert all(s != torch.cuda.default_stream() for s in streams if s is not None)
        messages = [ChatMessage("user", "What is the capital of France?")]
        params = SamplingParams(max_tokens=24, temperature=0.0)
        text = "".join([out.text async for out in engine.generate(messages, params)])
        assert "Paris" in text
        workers = {w.name: w for w in engine.stats().workers}
        assert workers["prefill"].num_steps > 0 and workers["decode"].num_steps > 0
        engine.check_integrity()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_split_device_groups_give_the_one_device_tokens() -> None:
    """Prefill on cuda:0, decode on cuda:1 (a replica and a pool each, KV copied on transfer
    streams), decode from CUDA graphs on cuda:1: the tokens of one device."""
    one = _greedy(_config("cuda", "triton"))
    split = _config("cuda", "triton").replace(
        workers=WorkersConfig(prefill_devices=("cuda:0",), decode_devices=("cuda:1",))
    )
    tokens, core = _greedy_core(split)
    assert core.info.decode_device == torch.device("cuda", 1)
    graphs = core.decode_runner.graphs
    assert graphs is not None and graphs.decode is not None and graphs.decode.num_replays > 0
    assert tokens == one


async def test_drafts_under_a_grammar_keep_the_tokens() -> None:
    """Packed masks with a row per verified position (the grammar walked along each request's
    drafts) on CUDA, float32: a JSON schema's answer drafted from a prediction of itself, and
    from one the grammar refuses at once, gives the tokens it gives without one."""
    schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(max_tokens=48, temperature=0.0, structured=spec)
    messages = [ChatMessage("user", "Write a Python function that adds two numbers, as JSON.")]

    async def run(engine: AsyncEngine, prediction: str | None) -> tuple[list[int], str, int]:
        ids: list[int] = []
        text, accepted = "", 0
        async for out in engine.generate(messages, params, prediction=prediction):
            ids += out.token_ids
            text += out.text
            accepted = out.usage.accepted_prediction_tokens if out.usage else accepted
        return ids, text, accepted

    async with AsyncEngine(_config("cuda", "triton")) as engine:
        want, answer, _ = await run(engine, None)
        got, _, accepted = await run(engine, answer)
        assert got == want and accepted > 0
        refused, _, _ = await run(engine, "Sure! Here it is: " + answer)
        assert refused == want
        engine.check_integrity()
