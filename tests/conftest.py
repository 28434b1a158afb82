import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from deepinfer.environment import default_model_dir as _default_model_dir
from deepinfer.model.loading.gguf_loader import open_gguf

if TYPE_CHECKING:
    from tests.api.live_server import LiveServer  # tests/api, on the path by pyproject's pythonpath

# Triton kernels run on CPU tensors through its interpreter; it must be chosen before any kernel
# module is imported (Triton decides per @jit function at import), hence the top-level conftest.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The disk prefix cache defaults to $XDG_CACHE_HOME/deepinfer: keep every test session's cache
# private and fresh, so no test hits (or pollutes) a user's cache or an earlier run's. The model
# directory (`deepinfer pull`'s) stays the user's: pin it before moving the cache.
os.environ.setdefault("DEEPINFER_MODEL_DIR", str(_default_model_dir()))
# So does the native kernels' build cache (kernels/native/cpu_native.py; keyed by sources, headers and
# flags, so sharing it is safe): else every session, and every server it starts, compiles again.
_user_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
os.environ.setdefault("DEEPINFER_NATIVE_DIR", str(Path(_user_cache) / "deepinfer" / "native"))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="deepinfer-test-cache-")


HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 4, 2, 2, 49152
"""The shape of `tiny_llama_dir` (tests that depend on it repeat what they use)."""


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama written straight to safetensors (no transformers import), with
    the real tokenizer (its vocabulary covers the embedding)."""
    import torch
    from safetensors.torch import save_file

    from deepinfer.environment import default_model_path
    from deepinfer.text.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    g = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    tensors = {"embed_tokens.weight": w(VOCAB, HIDDEN), "norm.weight": 1.0 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1.0 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1.0 + w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": w(2 * HIDDEN, HIDDEN),
            p + "mlp.up_proj.weight": w(2 * HIDDEN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, 2 * HIDDEN),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": True,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path


@pytest.fixture(scope="session")
def real_server() -> Iterator["LiveServer"]:
    """The real engine on SmolLM2 behind the API, started by the app's lifespan (slow tests);
    one per session, shared by every folder."""
    from deepinfer.api.app import create_app
    from deepinfer.config import CacheConfig, Config, ModelConfig, SchedulerConfig, WorkersConfig
    from deepinfer.engine.async_engine import AsyncEngine
    from tests.api.live_server import LiveServer

    config = Config(
        model=ModelConfig(dtype="float32", matmul_activations="float32"),  # exact numerics
        cache=CacheConfig(num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_waiting=256),
        # disaggregated (the default), lending idle cores: a lone request uses both
        workers=WorkersConfig(lend_idle_threads=True),
    )
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=300)
    try:
        yield server
    finally:
        server.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests first, each file's tests in their order: two xdist workers take a
    file at a time (`--dist loadscope`), so the long files start early and the many short ones
    even out the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
