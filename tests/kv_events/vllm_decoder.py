"""vLLM's own decoding of KV event batches, where the vllm package is installed.

`vllm/distributed/kv_events.py` imports vLLM's config, logger and network helpers, which pull in
most of vLLM (and a GPU build's dependencies). Its event classes need none of them: this loads
that file from the installed package with those four imports stubbed, so the classes are
vLLM's, unmodified. None when vllm is not installed (`pip install --no-deps vllm` suffices)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any


@functools.cache
def vllm_batch_decoder() -> Callable[[bytes], Any] | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_events.py"
    if not source.exists():
        return None
    stubs = {
        "vllm.config.kv_events": {"KVEventsConfig": object},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils.network_utils": {
            "get_ip": None,
            "get_tcp_uri": None,
            "is_valid_ipv6_address": None,
            "split_zmq_path": None,
        },
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, attrs in stubs.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        module_spec = importlib.util.spec_from_file_location("vllm_kv_events", source)
        assert module_spec is not None and module_spec.loader is not None
        kv_events = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(kv_events)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    import msgspec

    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    return decoder.decode
