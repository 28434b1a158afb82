"""`Sampler`: turns one step's logits `[B, V]` into one `SampledToken` per row.

The pipeline, per row (vLLM / HF semantics):

0. `logit_bias` added and the row's allowed-token mask applied (structured output), batched:
   one masked fill, or one add of an additive mask (`masking.py`);
1. suppression, repetition penalty, presence/frequency penalties (`penalties.py`): the
   *processed logits*, which decide greedy picks and logprobs;
2. rows with temperature 0 (below `GREEDY_TEMPERATURE`): argmax of the processed logits;
3. other rows: temperature, top-k, top-p, min-p (`filters.py`), softmax, then one inverse-CDF
   draw with a number from the row's generator (`generators.py`).

Logprobs (when `params.logprobs` is not None) are `log_softmax` of the processed logits: after
suppression and penalties, before temperature and the filters. They are the model's distribution
under the request's hard constraints, the same whatever temperature or top-p a client picks (as
vLLM's default reports the unshaped distribution), and the sampled token always has a finite
logprob (it was never suppressed, but see the guards below). `top_logprobs` holds the `params.logprobs` most likely tokens
of that distribution, most likely first.

Work is grouped, not looped: all greedy rows share one argmax, all sampled rows one softmax,
one cumulative sum and one binary search, all logprob rows one log_softmax and one topk.

Numeric guards: whatever the logits hold (NaN, +-inf, every token suppressed), every id is in
`[0, V)` and the chosen token's logprob is finite. A row is *unsound* when its greedy pick is not finite
(a NaN or +inf logit, or nothing but -inf) or its warped distribution is not one (NaN, +inf,
overflow, no mass). Sound rows, the common case, cost one `[B]` check and nothing else. Each
unsound row is repaired and chosen again (sampled rows draw again from their own generator):

- NaN logits become -inf (never chosen while any other token can be), +inf logits the largest
  float32 (chosen first: greedy takes the first of them, logprob 0);
- a row left with no token above -inf (every token suppressed, or all -inf after penalties)
  ignores suppression and penalties: its biased and masked logits, repaired alike, decide (a
  constrained row's mask always allows its stop tokens when nothing else: it ends);
- a row whose biased and masked logits have no token above -inf either is uniform (greedy: token 0);
- a repaired row whose distribution is still unsound (the temperature overflowed its +inf
  stand-ins) takes the argmax of its repaired logits.

The repaired logits are the row's processed logits for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import torch

from deepinfer.kernels.native.greedy import greedy_ids
from deepinfer.outputs import SampledToken
from deepinfer.sampling.filters import warp
from deepinfer.sampling.generators import inverse_cdf_pick, uniform_draws
from deepinfer.sampling.masking import bias_and_mask
from deepinfer.sampling.penalties import apply_penalties, apply_suppression
from deepinfer.sampling.row import SamplingRow

__all__ = ["Sampler", "SamplingRow"]

_PLAIN = attrgetter("plain_greedy")
_WIDENS_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)
"""Logits whose argmax is that of their float32 copy (the one the full pipeline takes)."""


class Sampler:
    """Stateless but for the shared generator, used by rows that bring none of their own."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device)
        self._shared.manual_seed(seed % (1 << 64))
        self._plain: dict[int, SampledToken] = {}
        """A `SampledToken` without log-probabilities per id, made once (they are immutable)."""

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        token_mask: torch.Tensor | None = None,
    ) -> list[SampledToken]:
        """One token per row of `logits` (`[B, V]`, on the sampler's device; never modified).
        `token_mask` (packed int32 `[B, W]` or additive float32 `[B, V]`, see `masking.py`):
        the tokens each row may take; None allows every token."""
        plain = logits.dtype in _WIDENS_EXACTLY and all(map(_PLAIN, rows))
        if plain and token_mask is None:
            ids: list[int] = greedy_ids(logits).tolist()  # the common step: argmax alone
            if not ids or min(ids) >= 0:
                return _plain_tokens(ids, self._plain)
        base = bias_and_mask(logits, rows, token_mask)  # [B, V] float32
        if plain and token_mask is not None:  # a grammar's step: the argmax of masked logits
            ids = greedy_ids(base).tolist()
            if not ids or min(ids) >= 0:
                return _plain_tokens(ids, self._plain)
        processed = self.process_logits(base, rows)  # [B, V]
        token_ids = self.choose(processed, rows)  # [B], -1 where unsound
        ids = token_ids.tolist()  # checked on the list: no more ops (GIL retakes)
        if ids and min(ids) < 0:
            processed, token_ids = self._repair(base, processed, token_ids, rows)
            ids = token_ids.tolist()
        return _package(processed, token_ids, ids, rows, self._plain)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`logits` in float32 with suppression and penalties applied (step 1): a copy when any
        row asks for either, else `logits` itself when it is float32 already (never written)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per row"
        assert logits.device.type == self.device.type, "logits on the sampler's device"
        adjusted = any(row.suppress_token_ids or row.params.needs_penalties for row in rows)
        if logits.dtype == torch.float32 and not adjusted:
            return logits
        processed = logits.to(torch.float32, copy=adjusted)
        if adjusted:
            apply_suppression(processed, rows)
            apply_penalties(processed, rows)
        return processed

    def choose(self, processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids `[B]` (int64) from processed logits: argmax or a draw (steps 2 and 3);
        -1 for an unsound row (see the module docstring)."""
        greedy = [i for i, row in enumerate(rows) if row.greedy]
        if len(greedy) == len(rows):
            return greedy_ids(processed)
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if len(sampled) == len(rows):
            return self._draw(processed, rows)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=processed.device)
        greedy_index = torch.tensor(greedy, device=processed.device)
        sampled_index = torch.tensor(sampled, device=processed.device)
        token_ids[greedy_index] = greedy_ids(processed[greedy_index])
        token_ids[sampled_index] = self._draw(processed[sampled_index], [rows[i] for i in sampled])
        return token_ids

    def _draw(self, processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # Row-contiguous first: softmax, sort and cumsum along a strided dim are much slower.
        probs = warp(processed.contiguous(), [row.params for row in rows]).softmax(dim=1)  # [S, V]
        draws = uniform_draws([row.generator for row in rows], self._shared, probs.device)
        return inverse_cdf_pick(probs, draws)  # [S]

    def _repair(
        self,
        logits: torch.Tensor,  # [B, V] biased and masked
        processed: torch.Tensor,  # [B, V]
        token_ids: torch.Tensor,  # [B], -1 where unsound
        rows: Sequence[SamplingRow],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unsound rows repaired and chosen again (rare: a row per Python call is fine)."""
        index = (token_ids < 0).nonzero().squeeze(1)  # [R]
        repaired = repair_logits(processed[index], logits[index])  # [R, V]
        again = self.choose(repaired, [rows[i] for i in index.tolist()])  # [R]
        again = torch.where(again >= 0, again, repaired.argmax(dim=1))
        return processed.index_copy(0, index, repaired), token_ids.index_copy(0, index, again)


def repair_logits(processed: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """`[R, V]` float32 logits with no NaN or +inf and a token above -inf in every row: NaN as
    -inf, +inf as the largest float32; a row with nothing left takes its raw logits (suppression
    and penalties ignored), and a row with nothing there either is uniform (all 0)."""
    largest = torch.finfo(torch.float32).max
    ninf = float("-inf")
    out = processed.nan_to_num(nan=ninf, posinf=largest, neginf=ninf)
    fallback = raw.to(torch.float32).nan_to_num(nan=ninf, posinf=largest, neginf=ninf)
    empty = (out == ninf).all(dim=1, keepdim=True)  # [R, 1]
    out = torch.where(empty, fallback, out)
    return out.masked_fill((out == ninf).all(dim=1, keepdim=True), 0.0)


def _plain_tokens(ids: list[int], plain: dict[int, SampledToken]) -> list[SampledToken]:
    """`SampledToken`s without log-probabilities, each made once per id."""
    return [plain.get(t) or plain.setdefault(t, SampledToken(t)) for t in ids]


def _package(
    processed: torch.Tensor,
    token_ids: torch.Tensor,
    ids: list[int],
    rows: Sequence[SamplingRow],
    plain: dict[int, SampledToken],
) -> list[SampledToken]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return _plain_tokens(ids, plain)
    index = torch.tensor(wanted, device=processed.device)
    logprobs = torch.log_softmax(processed[index], dim=1)  # [L, V]
    chosen: list[float] = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if num_top > 0:
        top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = [SampledToken(token_id=t) for t in ids]
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        pairs = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[i] = SampledToken(token_id=ids[i], logprob=chosen[j], top_logprobs=pairs)
    return out
