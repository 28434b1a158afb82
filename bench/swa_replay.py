"""A sliding-window model behind the prefix cache: what a cached token costs, what a resumed
session waits, what a long request holds (Gemma 3 270M: 15 of 18 layers attend 512 keys).

Engine only (`EngineCore.step`, no HTTP), one colocated lane, the serving defaults otherwise,
`--window-kv window` (the default: the windowed layers keep their window in a pool of their
own, the cache stores the full layers for every block) against `--window-kv all` (every layer
keeps every token and is cached).
- Bytes stored per cached token: the KV one token takes in a block of the host and disk tiers
  (the full layers only, or every layer), keys and values, at the serving KV dtype; and with
  the windowed layers' window the disk tier keeps before each prompt's end, per token of a
  session of each length.
- Resumed agent session: a session of N prompt tokens has run (its blocks cached); its next
  turn, the same N tokens and 64 more, is timed to its first token: resumed from the windows
  the windowed pool still holds (exact, nothing replayed), by a bounded replay (the windowed
  pool's cache emptied first, as after a restart from the disk tier), with every layer
  cached, and with no prefix cache (all N + 64 tokens computed).
- Peak KV of a long request: the most bytes of blocks one request of N tokens holds while it
  is prefilled and decodes (both pools).

Run from the repository root (the 32k-token requests take minutes on 2 cores):

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
from deepinfer.model.kv_layout import kv_bytes_per_block
from deepinfer.request import Request, SamplingParams
from deepinfer.tiers.copies import block_payload_bytes

GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
TURN_TOKENS = 64


def make_core(path: Path, num_blocks: int, prefix_caching: bool, window_kv: str) -> EngineCore:
    return EngineCore(
        Config(
            model=ModelConfig(path=path),
            cache=CacheConfig(
                num_blocks=num_blocks,
                enable_prefix_caching=prefix_caching,
                window_kv=window_kv,  # type: ignore[arg-type]
            ),
            disk_cache=DiskCacheConfig(enabled=False),
            scheduler=SchedulerConfig(max_num_seqs=4),
            workers=WorkersConfig(colocated=True),
        )
    )


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200000) for _ in range(length - 1)]  # BOS, then text ids


def held_bytes(core: EngineCore, rid: str) -> int:
    """Bytes of the blocks a request holds now, in both pools."""
    arch, info = core.runner.model.arch, core.info
    kv, size = core.kv, info.block_size
    if kv.window is None:
        return kv.num_blocks_of(rid) * kv_bytes_per_block(arch, size, info.kv_dtype)
    n_w = kv.window.spec.num_windowed_layers
    full = kv_bytes_per_block(arch, size, info.kv_dtype, arch.num_layers - n_w)
    windowed = kv_bytes_per_block(arch, size, info.kv_dtype, n_w)
    return kv.num_blocks_of(rid) * full + kv.window.num_held(rid) * windowed


def run(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, most bytes of blocks the request held)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(Request(request_id=rid, prompt_token_ids=ids, sampling=params))
    start, first, peak = time.perf_counter(), None, 0
    while core.has_work:
        deltas = core.step()
        peak = max(peak, held_bytes(core, rid))
        if first is None and any(d.request_id == rid for d in deltas):
            first = time.perf_counter() - start
    assert first is not None
    return first, peak


def resumed_ttft(path: Path, length: int, mode: str) -> float:
    """The next turn's TTFT. mode: `stored` (windows held), `replay`, `all`, `cold`."""
    blocks = 2 * (length + TURN_TOKENS) // 16 + 64
    window_kv = "all" if mode == "all" else "window"
    core = make_core(path, blocks, mode != "cold", window_kv)
    session = prompt(length, length)
    run(core, "turn-1", session, 1)
    if mode == "replay":
        assert core.kv.window is not None
        core.kv.window.pool.reset_prefix_cache()
    ttft, _ = run(core, "turn-2", session + prompt(length + 1, TURN_TOKENS), 1)
    core.close()
    return ttft


def long_request(path: Path, length: int, window_kv: str) -> tuple[int, int, int]:
    """(bytes a cached token takes in the lower tiers, bytes of the windowed layers' blocks the
    disk tier keeps before a prompt's end (0: none), peak bytes of a `length`-token request)."""
    core = make_core(path, length // 16 + 64, True, window_kv)
    per_token = block_payload_bytes(core.tiers.copies.kv_caches) // core.info.block_size
    window = core.kv.window
    boundary = 0
    if window is not None:
        size = core.info.block_size
        blocks = -(-(window.spec.window - 1) // size)  # at most: the blocks of one window
        boundary = blocks * block_payload_bytes(core.tiers.copies.window_caches)
    _, peak = run(core, "long", prompt(0, length - 4), 4)  # the context holds `length` in all
    core.close()
    return per_token, boundary, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=GEMMA3)
    ap.add_argument("--sessions", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long request")
    ns = ap.parse_args()
    path = ns.model.expanduser()
    print(f"\n### Sliding-window cache: `bench/swa_replay.py`\n\n{provenance()}\n")
    window_token, boundary, window_peak = long_request(path, ns.long, "window")
    all_token, _, all_peak = long_request(path, ns.long, "all")
    print(f"- bytes stored per cached token: {window_token} (full layers) vs {all_token} "
          f"(every layer): {all_token / window_token:.1f}x fewer; the window kept before a "
          f"prompt's end adds {boundary / 1e6:.1f} MB a prompt")  # fmt: skip
    for n in ns.sessions:
        with_boundary = (n * window_token + boundary) / n
        print(f"  - a {n}-token session with its prompt-end window: {with_boundary:.0f} bytes "
              f"per token, {all_token / with_boundary:.1f}x fewer than every layer")  # fmt: skip
    print(f"- peak KV of a {ns.long}-token request: {window_peak / 1e6:.1f} MB (windowed "
          f"layers keep their window) vs {all_peak / 1e6:.1f} MB (every layer every token)")  # fmt: skip
    for length in ns.sessions:
        t = {mode: resumed_ttft(path, length, mode) for mode in ("stored", "replay", "all", "cold")}
        print(f"- resumed {length}-token session, next turn's TTFT: {t['stored']:.2f} s from "
              f"stored windows, {t['replay']:.2f} s by bounded replay, {t['all']:.2f} s with "
              f"every layer cached ({t['stored'] / t['all']:.2f}x, {t['replay'] / t['all']:.2f}x "
              f"of it), {t['cold']:.2f} s without cache")  # fmt: skip


if __name__ == "__main__":
    main()
