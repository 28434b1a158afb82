"""A sliding-window model behind the prefix cache: what a cached token costs, what a resumed
session waits, what a long request holds (Gemma 3 270M: 15 of 18 layers attend 512 keys).

Engine only (`EngineCore.step`, no HTTP), one colocated lane, the serving defaults otherwise.
- Bytes stored per cached token: the KV one token takes in a cached block, keys and values of
  every layer the cache stores it for, at the serving KV dtype.
- Resumed agent session: a session of N prompt tokens has run (its blocks cached); its next
  turn, the same N tokens and 64 more, is timed to its first token. Against an engine with no
  prefix cache, where the turn computes all N + 64 tokens.
- Peak KV of a long request: the most blocks one request of N tokens holds while it is
  prefilled and decodes, times the bytes of a block.

Run from the repository root (the 32k-token request takes a few minutes on 2 cores):

    python bench/swa_replay.py
    python bench/swa_replay.py --sessions 8192 --long 16384
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from common import provenance

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.core import EngineCore
from deepinfer.environment import default_model_dir
from deepinfer.model.gguf_loader import gguf_arch, open_gguf
from deepinfer.model.kv_layout import kv_bytes_per_block
from deepinfer.request import Request, SamplingParams

GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
TURN_TOKENS = 64


def make_core(path: Path, num_blocks: int, prefix_caching: bool) -> EngineCore:
    return EngineCore(
        Config(
            model=ModelConfig(path=path),
            cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            disk_cache=DiskCacheConfig(enabled=False),
            scheduler=SchedulerConfig(max_num_seqs=4),
            workers=WorkersConfig(colocated=True),
        )
    )


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200000) for _ in range(length - 1)]  # BOS, then text ids


def run(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, most blocks the request held)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(Request(request_id=rid, prompt_token_ids=ids, sampling=params))
    start, first, peak = time.perf_counter(), None, 0
    while core.has_work:
        deltas = core.step()
        peak = max(peak, core.kv.num_blocks_of(rid))
        if first is None and any(d.request_id == rid for d in deltas):
            first = time.perf_counter() - start
    assert first is not None
    return first, peak


def resumed_ttft(path: Path, length: int, prefix_caching: bool) -> float:
    blocks = 2 * (length + TURN_TOKENS) // 16 + 64
    core = make_core(path, blocks, prefix_caching)
    session = prompt(length, length)
    run(core, "turn-1", session, 1)
    ttft, _ = run(core, "turn-2", session + prompt(length + 1, TURN_TOKENS), 1)
    core.close()
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=GEMMA3)
    ap.add_argument("--sessions", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long request")
    ns = ap.parse_args()
    path = ns.model.expanduser()
    core = make_core(path, ns.long // 16 + 64, prefix_caching=True)
    arch, info = gguf_arch(open_gguf(path)), core.info
    block = kv_bytes_per_block(arch, info.block_size, info.kv_dtype)
    _, peak = run(core, "long", prompt(0, ns.long), 4)
    core.close()
    windowed = sum(1 for i in range(arch.num_layers) if arch.window(i) is not None)
    print(f"\n### Sliding-window cache: `bench/swa_replay.py`\n\n{provenance()}\n")
    print(f"{path.name}: {arch.num_layers} layers, {windowed} of them windowed; KV "
          f"{info.kv_dtype}, blocks of {info.block_size} tokens.\n".replace("torch.", ""))  # fmt: skip
    print(f"- bytes stored per cached token: {block // info.block_size} (every layer)")
    print(f"- peak KV of a {ns.long}-token request: {peak} blocks, {peak * block / 1e6:.1f} MB")
    for length in ns.sessions:
        cached = resumed_ttft(path, length, True)
        cold = resumed_ttft(path, length, False)
        print(f"- resumed {length}-token session, next turn's TTFT: {cached:.2f} s from the "
              f"cache (every layer stored), {cold:.2f} s without ({cold / cached:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
