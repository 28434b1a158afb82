"""Turning logits into tokens: penalties, temperature and filters, seeded draws, logprobs."""

from deepinfer.sampling.generators import make_generator, request_seed
from deepinfer.sampling.row import GREEDY_TEMPERATURE, SamplingRow
from deepinfer.sampling.sampler import Sampler

__all__ = ["GREEDY_TEMPERATURE", "Sampler", "SamplingRow", "make_generator", "request_seed"]
