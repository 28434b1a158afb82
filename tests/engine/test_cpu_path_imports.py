"""The CPU path never imports Triton: a fresh interpreter imports the engine, builds a tiny CPU
engine, generates a token, and finds no `triton` module loaded. (Triton is a dependency where it
installs, for CUDA; loading it costs start-up time and memory a CPU server does not need.) Only
the Triton launcher modules of `deepinfer.kernels` import it, and only the `triton` backend
imports them; the references, `dispatch` and the native CPU kernels the CPU path uses do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams

config = Config(
    model=ModelConfig(path=Path(sys.argv[1]), dtype="float32"),
    cache=CacheConfig(num_blocks=16),
    disk_cache=DiskCacheConfig(enabled=False),
)

async def main() -> list[int]:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        return [t async for out in engine.generate([100, 200, 300], params) for t in out.token_ids]

tokens = asyncio.run(main())
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "triton")
print(json.dumps({"tokens": tokens, "triton": loaded}))
"""


@pytest.mark.slow
def test_cpu_engine_never_imports_triton(tiny_llama_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama_dir)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 2, "the engine did not run a step"
    assert result["triton"] == []
