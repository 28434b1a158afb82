"""What the embedding API hands back: one `GenerationOutput` per delivered delta."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.cache.disk.tier import DiskTierStats
from deepinfer.outputs import SampledToken
from deepinfer.request import FinishReason


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache (not recomputed), all tiers."""
    disk_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded from the disk tier."""

    @property
    def device_cached_tokens(self) -> int:
        return self.cached_tokens - self.disk_cached_tokens


@dataclass(frozen=True)
class GenerationOutput:
    """New output of one request since the previous one (deltas merge for slow readers)."""

    request_id: str
    text: str
    """New text; never half a UTF-8 character, never any part of a matched stop string."""
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    """The stop string or stop token id that ended generation, if any."""
    usage: Usage

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_blocks_used: int
    max_model_len: int
    disk: DiskTierStats | None = None
    """The disk tier's counters, when it is enabled."""
