"""The sampler's greedy pick: each row's first largest logit, -1 where that value is not finite
(a NaN in the row, +inf, or no value above -inf; the sampler repairs those rows).

On CPU the native kernel (`cpu/sampling.c`) does it in one pass over each row; elsewhere, and
where the native library is missing, torch's argmax and a check of the picked value.
"""

from __future__ import annotations

import torch

from .cpu_native import native_available, native_library


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`[B]` int64 ids from `[B, V]` logits (rows of unit stride)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.shape[1] > 0
        and native_available()
    ):
        rows, vocab = logits.shape
        ids = torch.empty(rows, dtype=torch.int64)
        stride = logits.stride(0) if rows > 1 else vocab
        # The calling worker's share of cores but one: the scan is bound by memory bandwidth
        # (256 rows of 49,152 logits: 2.0 ms on one thread, 1.4 ms on two), and the core left
        # over is the event loop's, streaming the previous step meanwhile (1.1x tokens/s to 256
        # streams on two cores, bench/RESULTS.md).
        threads = max(1, torch.get_num_threads() - 1)
        native_library().argmax_rows(
            logits.data_ptr(), stride, rows, vocab, ids.data_ptr(), threads
        )
        return ids
    return greedy_ids_reference(logits)


def greedy_ids_reference(logits: torch.Tensor) -> torch.Tensor:
    """torch's argmax (which takes a NaN first), then -1 where the picked value is not finite."""
    token_ids = logits.argmax(dim=1)  # [B]
    best = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
    return torch.where(torch.isfinite(best), token_ids, -1)
