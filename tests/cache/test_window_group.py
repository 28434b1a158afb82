"""The windowed layers' pool (`cache/window_group.py`) through `KVCacheManager`: blocks freed as
the window slides, prefix hits from a stored window or by a bounded replay (its start derived
in the module docstring), windows kept where prompts end, and the invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer.cache.manager import KVCacheManager
from deepinfer.cache.window_group import WindowSpec, best_window_end, window_pool_blocks
from deepinfer.request import Request, SamplingParams

BS = 4
SPEC = WindowSpec(window=8, num_windowed_layers=3)  # replays 3 x 7 = 21 positions at most


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _manager(track: bool = False) -> KVCacheManager:
    num_window = window_pool_blocks(SPEC, BS, max_num_seqs=4, max_step_tokens=16)
    return KVCacheManager(
        64, BS, "seed", True, track_new_blocks=track, window=SPEC, num_window_blocks=num_window
    )


def _prefill(kv: KVCacheManager, request: Request, chunk: int = 8) -> list[tuple[int, ...]]:
    """Admit and compute the prompt chunk by chunk as a scheduler would; the windowed table of
    every chunk."""
    hits, start = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - start, hits)
    request.num_computed_tokens = start
    tables = []
    while request.num_computed_tokens < request.num_tokens:
        end = min(request.num_computed_tokens + chunk, request.num_tokens)
        tables.append(kv.chunk_tables(request, end).window_block_ids)
        request.num_computed_tokens = end
        kv.cache_blocks(request)
        kv.check_integrity()
        kv.check_window(request)
    return tables


def test_replay_start_is_the_derived_bound() -> None:
    gemma = WindowSpec(window=512, num_windowed_layers=15)
    assert gemma.replay_start(8192, 16) == 8192 - 7680  # 15 x 511 = 7,665, in blocks of 16
    assert gemma.replay_start(4096, 16) == 0
    for hit_end in range(0, 200, BS):
        start = SPEC.replay_start(hit_end, BS)
        assert start % BS == 0 and 0 <= start <= max(0, hit_end - 21)
        # the first block the next query reads is exact in every windowed layer
        assert SPEC.exact_from(start, True) <= SPEC.first_block_needed(hit_end, BS) * BS


def test_best_window_end() -> None:
    stored = [False, True, True, True, False, True, True, False]  # blocks of 4, window of 8
    assert best_window_end(SPEC, BS, stored, 0) == 28  # blocks 5, 6 cover [21, 28)
    assert best_window_end(SPEC, BS, stored[:5], 0) == 16  # blocks 1..3 cover [9, 16)
    assert best_window_end(SPEC, BS, stored, 29) is None
    assert best_window_end(SPEC, BS, [True] * 2, 0) == 8  # from position 0
    assert best_window_end(SPEC, BS, [], 0) is None


def test_windowed_blocks_slide_and_stay_cached() -> None:
    kv = _manager()
    request = _request("a", list(range(100, 160)))  # 60 tokens: 7.5 windows
    tables = _prefill(kv, request)
    for table in tables:  # a chunk reads at most a window and its own 8 tokens
        assert sum(1 for b in table if b) <= -(-(8 - 1 + 8) // BS) + 1
    assert kv.window is not None
    assert kv.window.num_held("a") <= 3  # blocks of [53, 60) once the prompt is computed
    assert kv.num_blocks_of("a") == 15  # the full layers keep every block
    kv.free(request)
    kv.check_integrity()
    assert kv.usage().num_window_used_blocks == 0


def test_hits_resume_from_a_stored_window_or_replay() -> None:
    kv = _manager()
    first = _request("a", list(range(100, 160)))
    _prefill(kv, first)
    kv.free(first)
    # the same 60 tokens and more: every full block hits; the window before 60 is stored
    again = _request("b", [*range(100, 160), 7, 8, 9])
    hits, start = kv.get_computed_blocks(again)
    assert len(hits) == 15 and start == 60
    _prefill(kv, again)
    kv.free(again)
    kv.reset_prefix_cache()  # everything forgotten: nothing hits
    third = _request("c", list(range(100, 160)))
    _prefill(kv, third)
    kv.free(third)
    assert kv.window is not None
    kv.window.pool.reset_prefix_cache()  # the windowed pool forgets: a hit replays
    replay = _request("d", [*range(100, 160), 7, 8, 9])
    hits, start = kv.get_computed_blocks(replay)
    assert len(hits) == 15 and start == SPEC.replay_start(60, BS) == 36
    tables = _prefill(kv, replay)
    assert kv.chunk_tables(replay, replay.num_tokens).cached_until == 0  # the hit is past
    assert all(b == 0 for b in tables[0][: 36 // BS])  # nothing before the replay start
    kv.check_integrity()


def test_replayed_blocks_before_the_exact_front_are_never_hashed() -> None:
    kv = _manager()
    first = _request("a", list(range(100, 200)))
    _prefill(kv, first)
    kv.free(first)
    assert kv.window is not None
    kv.window.pool.reset_prefix_cache()
    replay = _request("b", [*range(100, 200), 1, 2, 3])
    _, start = kv.get_computed_blocks(replay)
    assert start == SPEC.replay_start(100, BS) > 0
    exact_from = SPEC.exact_from(start, True)
    _prefill(kv, replay)
    cached = {b.block_hash for b in kv.window.pool.blocks if b.block_hash is not None}
    hashes = kv.block_hashes(replay)
    for i, h in enumerate(hashes[: start // BS + 10]):
        if i * BS < exact_from:
            assert h not in cached, f"block {i} was replayed inexactly but is hashed"


@pytest.mark.parametrize("prompt_len", [5, 8, 23, 60])
def test_the_window_before_a_prompts_end_is_kept_for_the_lower_tiers(prompt_len: int) -> None:
    kv = _manager(track=True)
    request = _request("a", list(range(100, 100 + prompt_len)))
    _prefill(kv, request)
    windows = kv.drain_new_windows()
    end = prompt_len // BS * BS
    if end == 0:
        assert windows == []
        return
    ((blocks, _),) = windows
    hashes = kv.block_hashes(request)
    first = SPEC.first_block_needed(end, BS)
    assert [h for _, h in blocks] == hashes[first : end // BS]
    assert kv.drain_new_windows() == []  # once per request


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_sessions_keep_the_pools_sound(data: st.DataObject) -> None:
    """Random prompts sharing random prefixes of one session, prefilled in random chunks,
    decoded a few tokens, freed; the windowed pool's cache now and then forgotten. After every
    step: both pools' invariants, no block behind a request's window; on every admission the
    start is either the replay start or a boundary whose whole window the request now holds."""
    kv = _manager()
    window = kv.window
    assert window is not None
    base = data.draw(st.lists(st.integers(1, 9), min_size=8, max_size=70), label="session")
    for n in range(data.draw(st.integers(1, 6), label="requests")):
        shared = data.draw(st.integers(0, len(base)), label="shared")
        tail = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=12), label="tail")
        request = _request(f"r{n}", base[:shared] + tail)
        hits, start = kv.get_computed_blocks(request)
        hit_end = len(hits) * BS
        assert kv.allocate_slots(request, request.num_tokens - start, hits)
        request.num_computed_tokens = start
        replayed = start == SPEC.replay_start(hit_end, BS)
        event("no hit" if not hits else "replay" if replayed else "stored window")
        if start < hit_end and not replayed:
            first = SPEC.first_block_needed(start, BS)
            assert all(window.block_ids(request.request_id)[first : start // BS])
        while request.num_computed_tokens < request.num_tokens:
            chunk = data.draw(st.integers(1, 12), label="chunk")
            end = min(request.num_computed_tokens + chunk, request.num_tokens)
            kv.chunk_tables(request, end)
            request.num_computed_tokens = end
            kv.cache_blocks(request)
            kv.check_integrity()
            kv.check_window(request)
        for token in data.draw(st.lists(st.integers(1, 3), max_size=6), label="decoded"):
            request.output_token_ids.append(token)
            assert kv.allocate_slots(request, 1)
            kv.chunk_tables(request, request.num_computed_tokens + 1)
            request.num_computed_tokens += 1
            kv.cache_blocks(request)
            kv.check_integrity()
            kv.check_window(request)
        kv.free(request)
        if data.draw(st.booleans(), label="forget windows"):
            window.pool.reset_prefix_cache()
        kv.check_integrity()
    assert kv.usage().num_window_used_blocks == 0
