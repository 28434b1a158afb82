"""The host tier's settings: CLI flags -> `HostCacheConfig`, and validation."""

from __future__ import annotations

import argparse

import pytest

from deepinfer.args import add_engine_args, config_from_args
from deepinfer.config import Config, HostCacheConfig
from deepinfer.errors import ConfigError


def _parse(*flags: str) -> HostCacheConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(flags))).host_cache


def test_flags_map_to_config() -> None:
    assert _parse() == HostCacheConfig() == HostCacheConfig("auto", 8 << 30)
    assert _parse("--host-cache", "on", "--host-cache-gb", "0.5") == HostCacheConfig("on", 1 << 29)
    assert _parse("--host-cache", "on", "--no-host-cache").enabled == "off"


def test_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="1 MiB"):
        Config(host_cache=HostCacheConfig(max_bytes=1000))
    with pytest.raises(ConfigError, match="auto, on or off"):
        Config(host_cache=HostCacheConfig(enabled="yes"))  # type: ignore[arg-type]
