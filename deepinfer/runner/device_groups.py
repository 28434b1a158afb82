"""Where the prefill and decode workers run: `--prefill-devices` and `--decode-devices`.

Each group is one device for now (a group of several would shard the model across them: tensor
parallelism, not built). Both default to the runtime device. Two groups naming the same device
share one model and one KV pool (KV passes from prefill to decode by block ownership). Two groups
naming different devices of one type (`cuda:0` and `cuda:1`; on CPU `cpu:0` and `cpu:1`, for
instance one per NUMA node) each get their own model replica and KV pool, and KV is copied from
the prefill pool to the decode pool (`runner/kv_handoff.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import WorkersConfig
from deepinfer.errors import ConfigError
from deepinfer.runner.device import resolve_device


@dataclass(frozen=True)
class DeviceGroups:
    prefill: torch.device
    """Where the prefill worker's model and the prefix-cached KV pool live."""
    decode: torch.device
    """Where the decode worker's model and pool live (`prefill` itself when not split)."""
    split: bool
    """Separate model replicas and KV pools, KV copied on handoff."""


def _identity(device: torch.device) -> tuple[str, int]:
    return device.type, device.index or 0


def _group_device(flag: str, group: tuple[str, ...], runtime: torch.device) -> torch.device:
    if not group:
        return runtime
    if len(group) > 1:
        raise ConfigError(
            f"--{flag}-devices {','.join(group)}: one device per group in this version "
            "(sharding a worker's model over several devices is not built)"
        )
    try:
        device = resolve_device(group[0])
    except (ConfigError, RuntimeError) as exc:
        raise ConfigError(f"--{flag}-devices {group[0]}: {exc}") from exc
    if device.type != runtime.type:
        raise ConfigError(
            f"--{flag}-devices {group[0]}: both groups must be {runtime.type} devices, "
            f"like the runtime device {runtime}"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"--{flag}-devices {group[0]}: only {torch.cuda.device_count()} CUDA devices exist"
        )
    return device


def resolve_device_groups(config: WorkersConfig, runtime: torch.device) -> DeviceGroups:
    """The two workers' devices; raises ConfigError for a group this version cannot run."""
    prefill = _group_device("prefill", config.prefill_devices, runtime)
    decode = _group_device("decode", config.decode_devices, runtime)
    split = _identity(prefill) != _identity(decode)
    if split and config.colocated:
        raise ConfigError(
            "--colocated runs prefill and decode in one worker: give both groups one device"
        )
    if prefill.type == "cpu":  # CPU tensors have no device index; the groups stay apart by pool
        prefill, decode = torch.device("cpu"), torch.device("cpu")
    return DeviceGroups(prefill=prefill, decode=decode, split=split)
