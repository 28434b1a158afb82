"""The first step of sampling: each row's `logit_bias` added, then its allowed-token bitmask.

A bitmask is packed int32 `[B, W]` (W >= V / 32): bit t % 32 of word t // 32 of row i is set
when row i may sample token t (the layout of llguidance and xgrammar). Unconstrained rows are
all ones. The mask is applied to the whole batch as one masked fill; a masked token is -inf
before suppression, penalties, the greedy pick, filters and logprobs, so every sampling mode
sees the same constraint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sampling.row import SamplingRow


def bias_and_mask(
    logits: torch.Tensor,  # [B, V]
    rows: Sequence[SamplingRow],
    token_bitmask: torch.Tensor | None,  # [B, W] int32
) -> torch.Tensor:
    """float32 `[B, V]`: a copy with biases and the mask applied when there are any, else
    `logits` as float32 (never written)."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased and token_bitmask is None:
        return logits.to(torch.float32)
    out = logits.to(torch.float32, copy=True)
    if biased:
        _add_bias(out, [rows[i] for i in biased], biased)
    if token_bitmask is not None:
        allowed = unpack_bitmask(token_bitmask.to(out.device), out.shape[1])  # [B, V]
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
