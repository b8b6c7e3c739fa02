"""SamplingParams validation: bad values raise ValueError naming the field and the reason."""
from __future__ import annotations

import math

import pytest

from specd import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.stop_token_ids == [] and p.ignore_eos is False and p.logprobs is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=2.0),
        dict(temperature=1),  # ints are numbers too
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_k=100_000),
        dict(top_k=2**31 - 1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(max_tokens=1),
        dict(max_tokens=100_000),
        dict(seed=0),
        dict(seed=2**32),
        dict(stop_token_ids=[0, 5]),
        dict(stop_token_ids=(3,)),
        dict(logprobs=True),
        dict(logprobs=False),
        dict(logprobs=0),
        dict(logprobs=5),
        dict(ignore_eos=True),
    ],
)
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("temperature", -1e-9),
        ("temperature", 1e9),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0000001),
        ("top_p", 2.0),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", -100),
        ("top_k", 2.5),
        ("top_k", 2**31),  # int32 on the wire
        ("top_k", 2**63),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 10**12),
        ("max_tokens", 3.0),
        ("max_tokens", None),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", "2"),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", [2**32]),  # uint32 on the wire
        ("logprobs", -1),
        ("logprobs", 10**6),
    ],
)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    msg = str(exc.value)
    assert field in msg, f"message does not name {field!r}: {msg!r}"
    assert "\n" not in msg, f"message should be one line: {msg!r}"


def test_negative_temperature_message_says_why():
    with pytest.raises(ValueError, match=r"temperature must be >= 0.*-1"):
        SamplingParams(temperature=-1.0)


def test_bool_is_not_a_number():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=True)


def test_greedy_flag():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
