"""Turning logits into tokens: penalties, temperature and filters, seeded draws, logprobs.

The public names are imported lazily, so the grammar modules (and the grammar probe's child
process, `grammar_probe.py`) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GREEDY_TEMPERATURE": "deepinfer.sampling.row",
    "Sampler": "deepinfer.sampling.sampler",
    "SamplingRow": "deepinfer.sampling.row",
    "make_generator": "deepinfer.sampling.generators",
    "request_seed": "deepinfer.sampling.generators",
}

__all__ = ["GREEDY_TEMPERATURE", "Sampler", "SamplingRow", "make_generator", "request_seed"]

if TYPE_CHECKING:
    from deepinfer.sampling.generators import make_generator, request_seed
    from deepinfer.sampling.row import GREEDY_TEMPERATURE, SamplingRow
    from deepinfer.sampling.sampler import Sampler


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer.sampling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
