"""Random streams for sampling: per-request generators and the exponential race noise.

Sampling draws one Exp(1) variable per vocabulary entry and picks `argmax(probs / noise)`
(the exponential race, equivalent to Gumbel-max): an exact draw from `probs`, batched as one
argmax, with each row's noise coming from that row's own generator when it has one.

How requests are randomized (`make_generator`):
- a request with a `seed` gets a generator seeded with it: same seed, same prompt, same
  parameters => same output, whatever else shares its batches;
- an unseeded request gets a generator seeded from `blake2b(default_seed, request_index)`,
  where `default_seed` is `config.runtime.seed` and `request_index` counts requests since the
  engine started: a run is reproducible for the same arrival order, requests differ from one
  another, and no request's randomness depends on its batch neighbours (batch invariance).
- a row with no generator at all (`SamplingRow.generator=None`) draws from the sampler's shared
  generator in one batched call: the cheapest, but its draws depend on the batch.

Each sampled (non-greedy) step draws exactly `vocab_size` numbers from the row's generator, so
a generator must be created once per request and kept for the request's whole life.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

_SEED_MODULUS = 1 << 64
_TINY = torch.finfo(torch.float32).tiny


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


def exponential_noise(
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise `[S, V]`, row i from `generators[i]` (or from `shared` where None).

    Rows drawing from `shared` are drawn together in one call; the others one call each.
    Clamped away from 0 so that `probs / noise` is never 0/0.
    """
    num_rows = len(generators)
    noise = torch.empty(num_rows, vocab_size, device=device)  # [S, V]
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if len(shared_rows) == num_rows:
        noise.exponential_(generator=shared)
    else:
        if shared_rows:
            index = torch.tensor(shared_rows, device=device)
            drawn = torch.empty(len(shared_rows), vocab_size, device=device)
            noise[index] = drawn.exponential_(generator=shared)
        for i, generator in enumerate(generators):
            if generator is not None:
                assert generator.device.type == device.type, "generator on the wrong device"
                noise[i].exponential_(generator=generator)
    return noise.clamp_min_(_TINY)
