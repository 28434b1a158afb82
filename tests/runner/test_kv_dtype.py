"""`--kv-dtype float16` under float32 serving (the CPU default): K and V stored in half the bytes (twice the
blocks for a byte budget, a fingerprint of their own), refused where a kernel cannot read them,
and the real model still answering from such a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, RuntimeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.errors import ConfigError
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage

BUDGET = 4 << 20


def _config(kv_dtype: str, model: Path | None = None, backend: str = "auto") -> Config:
    return Config(
        model=ModelConfig(path=model, dtype="float32", matmul_activations="float32"),
        cache=CacheConfig(kv_dtype=kv_dtype, kv_memory_bytes=BUDGET),  # type: ignore[arg-type]
        disk_cache=DiskCacheConfig(enabled=False),
        runtime=RuntimeConfig(device="cpu", attention_backend=backend),  # type: ignore[arg-type]
    )


@pytest.mark.slow
def test_float16_cache_holds_twice_the_blocks_under_its_own_fingerprint(
    tiny_llama_dir: Path,
) -> None:
    wide = EngineCore(_config("float32", tiny_llama_dir))
    narrow = EngineCore(_config("auto", tiny_llama_dir))  # float16 under float32 on CPU
    assert wide.info.kv_dtype == torch.float32 and narrow.info.kv_dtype == torch.float16
    assert all(
        k.dtype == torch.float16 and v.dtype == torch.float16
        for k, v in narrow.tiers.copies.kv_caches
    )
    assert narrow.info.num_blocks == 2 * wide.info.num_blocks
    assert narrow.info.fingerprint != wide.info.fingerprint
    same = EngineCore(_config("float16", tiny_llama_dir))
    assert same.info.fingerprint == narrow.info.fingerprint
    triton = EngineCore(_config("auto", tiny_llama_dir, backend="triton"))
    assert triton.info.kv_dtype == torch.float32  # Triton reads the serving dtype only


def test_triton_backend_refuses_a_narrower_cache(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="kv-dtype float16"):
        EngineCore(_config("float16", tiny_llama_dir, backend="triton"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "torch"])
async def test_real_model_answers_from_a_float16_cache(backend: str) -> None:
    """The native decode kernel (auto, where it builds) and the torch path both read it."""
    expected = "cpu" if backend == "auto" and native_available() else "torch"
    async with AsyncEngine(_config("float16", backend=backend)) as engine:
        assert engine.info.attention_backend == expected
        messages = [ChatMessage("user", "What is the capital of France?")]
        params = SamplingParams(max_tokens=16, temperature=0.0)
        text = "".join([o.text async for o in engine.generate(messages, params)])
        engine.check_integrity()
    assert "Paris" in text
