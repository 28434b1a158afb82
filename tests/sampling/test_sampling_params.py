"""`SamplingParams` validation: every parameter within the range where float32 sampling is
sound, refused with an error naming the field and its range."""

from __future__ import annotations

import math

import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.request import GREEDY_TEMPERATURE, SamplingParams


@pytest.mark.parametrize(
    ("fields", "param", "allowed"),
    [
        ({"repetition_penalty": 1e-40}, "repetition_penalty", "[0.01, 100.0]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "[0.01, 100.0]"),
        ({"repetition_penalty": 1e6}, "repetition_penalty", "[0.01, 100.0]"),
        ({"repetition_penalty": math.nan}, "repetition_penalty", "finite"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"temperature": -1e-30}, "temperature", "[0, 100]"),
        ({"temperature": 1e3}, "temperature", "[0, 100]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", "[0, 2147483647]"),
        ({"top_k": 2**31}, "top_k", "[0, 2147483647]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty", "finite"),
        ({"seed": 2**64}, "seed", "64 bits"),
        ({"seed": -(2**63) - 1}, "seed", "64 bits"),
        ({"stop_token_ids": (5, 2**31)}, "stop_token_ids", "[0, 2147483647]"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids", "[0, 2147483647]"),
        ({"stop": ("",)}, "stop", "non-empty"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "max_tokens"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ],
)
def test_unsound_values_are_refused_naming_field_and_range(
    fields: dict[str, object], param: str, allowed: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert info.value.param == param
    assert info.value.message.startswith(param) and allowed in info.value.message


def test_bounds_themselves_are_accepted() -> None:
    SamplingParams(repetition_penalty=0.01, top_k=2**31 - 1, seed=2**64 - 1)
    SamplingParams(repetition_penalty=100.0, seed=-(2**63), stop_token_ids=(0, 2**31 - 1))


def test_many_stop_strings_are_left_to_the_api_limits() -> None:
    assert len(SamplingParams(stop=tuple(f"s{i}" for i in range(40))).stop) == 40


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-30).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
