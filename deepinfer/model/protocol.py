"""`CausalLM`: what the runner and engine may call on a loaded model, whatever its class."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches


class CausalLM(Protocol):
    """A decoder-only model over paged KV caches.

    `model(batch)` returns float32 logits `[B_sample, V]` for `batch.logits_indices` only, after
    writing the batch's new K/V into the bound caches at `batch.slot_mapping`.
    """

    arch: ModelArch
    attention_backend: AttentionBackend

    def __call__(self, batch: ForwardBatch) -> Any: ...

    def forward_hidden(self, batch: ForwardBatch, num_layers: int | None = None) -> torch.Tensor:
        """Final-normed hidden states `[B_sample, hidden]` of the `logits_indices` rows (after
        the first `num_layers` layers only, when given)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[B_sample, V]` of hidden states from `forward_hidden`."""
        ...

    def bind_kv_caches(self, kv_caches: KVCaches) -> None: ...

    def set_attention_backend(self, backend: AttentionBackend) -> None: ...
