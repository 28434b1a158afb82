"""Device and dtype resolution, done once at start-up."""

from __future__ import annotations

import torch

from deepinfer.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for CUDA, but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (exact, and fast enough there), bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_kv_dtype(name: str, serving: torch.dtype, narrow_ok: bool) -> torch.dtype:
    """`auto`: float16 under float32 serving where the kernels read it (`narrow_ok`; as llama.cpp
    stores its KV), else the serving dtype."""
    if name != "auto":
        return resolve_dtype(name, torch.device("cpu"))
    return torch.float16 if serving == torch.float32 and narrow_ok else serving
