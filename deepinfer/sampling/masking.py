"""The first step of sampling: each row's `logit_bias` added, then its allowed-token mask.

A mask comes in one of two forms, both `[B, ...]` over the whole batch:

- packed int32 `[B, W]` (W >= V / 32): bit t % 32 of word t // 32 of row i is set when row i may
  sample token t (the layout of llguidance and xgrammar); unconstrained rows are all ones. It is
  unpacked and applied as one masked fill (on the logits' device: 32x fewer bytes to move);
- additive float32 `[B, V]`: 0 where a token is allowed, -inf where not (`additive_mask`, made
  off the sampling path on CPU): the copy of the logits and the mask are then one add.

Either way a masked token is -inf before suppression, penalties, the greedy pick, filters and
logprobs, so every sampling mode sees the same constraint (a NaN or +inf logit at a masked
token becomes NaN under the add, which the sampler's guards turn into -inf).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.sampling.row import SamplingRow

_NEG_INF_BITS = np.uint32(0xFF800000)
"""The bits of float32 -inf (0 is all zero bits)."""
_BIT_FLOATS = np.where(
    (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1 == 1, np.uint32(0), _NEG_INF_BITS
).astype(np.uint32)
"""`[256, 8]`: the float32 bits of a mask byte's 8 tokens, bit k (little-endian) -> column k."""


def bias_and_mask(
    logits: torch.Tensor,  # [B, V]
    rows: Sequence[SamplingRow],
    token_mask: torch.Tensor | None,  # [B, W] int32 packed or [B, V] float32 additive
) -> torch.Tensor:
    """float32 `[B, V]`: a copy with biases and the mask applied when there are any, else
    `logits` as float32 (never written)."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased and token_mask is None:  # no op when float32 already (each drops the GIL)
        return logits if logits.dtype == torch.float32 else logits.to(torch.float32)
    additive = token_mask is not None and token_mask.dtype == torch.float32
    if additive:
        assert token_mask is not None and token_mask.shape == logits.shape, "one mask per logit"
        out = torch.add(logits.to(torch.float32), token_mask.to(logits.device))
    else:
        out = logits.to(torch.float32, copy=True)
    if biased:
        _add_bias(out, [rows[i] for i in biased], biased)
    if token_mask is not None and not additive:
        allowed = unpack_bitmask(token_mask.to(out.device), out.shape[1])  # [B, V]
        out.masked_fill_(~allowed, float("-inf"))
    return out


def _add_bias(out: torch.Tensor, rows: Sequence[SamplingRow], index: Sequence[int]) -> None:
    vocab_size = out.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in zip(index, rows, strict=True):
        for token_id, bias in row.params.logit_bias:
            if token_id < vocab_size:
                row_index.append(i)
                token_index.append(token_id)
                values.append(bias)
    if values:
        at = (
            torch.tensor(row_index, device=out.device),
            torch.tensor(token_index, device=out.device),
        )
        out.index_put_(at, torch.tensor(values, device=out.device), accumulate=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[B, W]` int32 packed -> `[B, V]` bool (tokens past the mask's width are not allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(2) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [B, 32 W]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size]


def additive_mask(words: np.ndarray, vocab_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Packed int32 `[B, W]` -> float32 `[B, V]`: 0 where a token is allowed, -inf where not
    (tokens past the mask's width are not allowed). Each byte of the words looks up its 8
    floats in one table (`np.take`, written straight into `out`). `out`: a reused uint32 buffer
    of at least B rows and `32 * max(W, ceil(V / 32))` columns (a view of it is returned, so no
    page is faulted in again each step); None allocates one."""
    assert words.dtype == np.int32 and words.ndim == 2, "packed int32 [B, W]"
    assert sys.byteorder == "little", "bit t of a word is bit t % 8 of its byte t // 8"
    num_rows, num_words = words.shape
    if num_words * 32 < vocab_size:  # the ids past the words are not allowed: zero bits
        pad = -(-vocab_size // 32) - num_words
        words = np.pad(words, ((0, 0), (0, pad)))
        num_words += pad
    if out is None:
        out = np.empty((num_rows, num_words * 32), dtype=np.uint32)
    assert out.dtype == np.uint32 and out.shape[1] == num_words * 32 and len(out) >= num_rows
    rows = out[:num_rows]  # [B, 32 W], contiguous
    np.take(
        _BIT_FLOATS,
        np.ascontiguousarray(words).view(np.uint8),  # [B, 4 W]
        axis=0,
        out=rows.reshape(num_rows, num_words * 4, 8),
        mode="clip",  # in range anyway; "raise" would buffer the output
    )
    return rows.view(np.float32)[:, :vocab_size]
