"""Random streams for sampling: per-request generators and the uniform draw of each step.

Sampling draws one uniform number u per row and picks the first token whose cumulative
probability exceeds `u * total` (inverse-CDF sampling): an exact draw from `probs`, batched as
one cumulative sum and one binary search, with each row's number coming from that row's own
generator when it has one. One number per row, not one per vocabulary entry: drawing 49k
exponentials per row for an exponential race cost more than the rest of a decode step.

How requests are randomized (`make_generator`):
- a request with a `seed` gets a generator seeded with it: same seed, same prompt, same
  parameters => same output, whatever else shares its batches;
- an unseeded request gets a generator seeded from `blake2b(default_seed, request_index)`,
  where `default_seed` is `config.runtime.seed` and `request_index` counts requests since the
  engine started: a run is reproducible for the same arrival order, requests differ from one
  another, and no request's randomness depends on its batch neighbours (batch invariance).
- a row with no generator at all (`SamplingRow.generator=None`) draws from the sampler's shared
  generator in one batched call: the cheapest, but its draws depend on the batch.

Each sampled (non-greedy) step draws exactly one float64 number from the row's generator, so a
generator must be created once per request and kept for the request's whole life.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

_SEED_MODULUS = 1 << 64


def request_seed(seed: int | None, default_seed: int, request_index: int) -> int:
    """The 64-bit seed of one request: its own `seed` if given, else one derived as above."""
    if seed is not None:
        return seed % _SEED_MODULUS
    key = f"deepinfer-sampling:{default_seed}:{request_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def make_generator(
    seed: int | None,
    default_seed: int,
    request_index: int,
    device: torch.device | str = "cpu",
) -> torch.Generator:
    """A request's own generator on `device` (the sampler's device); see the module docstring."""
    generator = torch.Generator(device=device)
    generator.manual_seed(request_seed(seed, default_seed, request_index))
    return generator


def uniform_draws(
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """U[0, 1) float64 `[S]`, entry i from `generators[i]` (or from `shared` where None).

    Rows drawing from `shared` are drawn together in one call; the others one call each."""
    num_rows = len(generators)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if len(shared_rows) == num_rows:
        return torch.rand(num_rows, generator=shared, dtype=torch.float64, device=device)
    draws = torch.empty(num_rows, dtype=torch.float64, device=device)
    if shared_rows:
        index = torch.tensor(shared_rows, device=device)
        drawn = torch.rand(len(shared_rows), generator=shared, dtype=torch.float64, device=device)
        draws.index_copy_(0, index, drawn)
    for i, generator in enumerate(generators):
        if generator is not None:
            assert generator.device.type == device.type, "generator on the wrong device"
            draws[i] = draw_one(generator)
    return draws


def draw_one(generator: torch.Generator) -> torch.Tensor:
    """One U[0, 1) float64 from a request's generator: the number one sampled step uses."""
    return torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)[0]


def inverse_cdf_pick(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Token ids `[S]`: in row i, the first token whose cumulative probability exceeds
    `draws[i] * total`, which picks token t with probability `probs[i, t] / total`.

    Never a zero-probability token: the pick is capped at the last token with mass (rounding
    could otherwise push `u * total` onto the total itself). A row that is no distribution (its
    total is NaN, infinite or 0) gets -1, never an id past the vocabulary."""
    cdf = probs.cumsum(dim=1, dtype=torch.float64)  # [S, V], non-decreasing
    total = cdf[:, -1:].contiguous()  # [S, 1]
    picked = torch.searchsorted(cdf, draws.unsqueeze(1) * total, right=True)  # [S, 1]
    last = torch.searchsorted(cdf, total)  # [S, 1], first index reaching the total
    valid = torch.isfinite(total) & (total > 0)  # [S, 1]
    return torch.where(valid, torch.minimum(picked, last), -1).squeeze(1)
