"""`SamplingRow`: everything the sampler needs to know about one request for one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.request import GREEDY_TEMPERATURE, SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "SamplingRow"]


@dataclass(frozen=True, eq=False)
class SamplingRow:
    """One row of the logits batch: a request's parameters and the tokens it has seen.

    The token sequences are read during `Sampler.sample` only, so the engine may pass the
    request's own lists without copying them.
    """

    params: SamplingParams
    output_token_ids: Sequence[int] = ()
    """Tokens generated so far (presence/frequency and repetition penalties)."""
    prompt_token_ids: Sequence[int] = ()
    """Prompt tokens (repetition penalty only)."""
    generator: torch.Generator | None = None
    """This request's own random stream (see `make_generator`), on the sampler's device;
    None draws from the sampler's shared generator."""
    suppress_token_ids: frozenset[int] = frozenset()
    """Token ids that may not be sampled this step (e.g. end-of-turn before min_tokens).
    Ids outside the vocabulary are ignored: they cannot be sampled anyway. When every token of
    the row is suppressed, the sampler ignores suppression for that row (see `Sampler`)."""
    plain_greedy: bool = field(init=False, repr=False)
    """Greedy, with no bias, suppression or penalty to apply and no logprobs to report: the
    row's pick is the argmax of its raw logits (set once here, read for every row every step)."""

    def __post_init__(self) -> None:
        p = self.params
        plain = p.greedy and not (p.logit_bias or p.needs_penalties or self.suppress_token_ids)
        object.__setattr__(self, "plain_greedy", plain and p.logprobs is None)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None
