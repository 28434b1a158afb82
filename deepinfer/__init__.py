"""deepinfer: an LLM serving engine in one asyncio process.

The public names are imported lazily, so `import deepinfer` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First, before any module of ours imports torch: OpenMP's barrier waits (see the module).
from deepinfer import openmp_env as _openmp_env  # noqa: F401
from deepinfer import source_tree as _source_tree

_source_tree.install()  # `deepinfer.kernels` from a checkout's top-level kernels/ (see the module)

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "deepinfer.engine.async_engine",
    "ChatMessage": "deepinfer.text.recipe",
    "Config": "deepinfer.config",
    "SamplingParams": "deepinfer.request",
    "GenerationOutput": "deepinfer.engine.types",
}

__all__ = [
    "AsyncEngine",
    "ChatMessage",
    "Config",
    "GenerationOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from deepinfer.config import Config
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.types import GenerationOutput
    from deepinfer.request import SamplingParams
    from deepinfer.text.recipe import ChatMessage


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
