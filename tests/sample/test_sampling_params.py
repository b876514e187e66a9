"""SamplingParams defaults and validate(): every out-of-range field is named in the error."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams


def test_defaults_are_valid_and_follow_openai() -> None:
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        1,
        1.0,
        1.0,
        0,
        16,
    )
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=5),
        dict(top_p=0.01),
        dict(min_p=1.0),
        dict(temperature=0.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=4, min_tokens=4),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(prompt_logprobs=3),
        dict(logit_bias={0: -100.0, 99: 100.0}),
        dict(stop_token_ids=[0, 99]),
    ],
)
def test_accepts_boundary_values(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=100)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", dict(n=0)),
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-2)),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.1)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("frequency_penalty", dict(frequency_penalty=-2.5)),
        ("max_tokens", dict(max_tokens=0)),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(max_tokens=4, min_tokens=5)),
        ("logprobs", dict(logprobs=-1)),
        ("logprobs", dict(logprobs=21)),
        ("prompt_logprobs", dict(prompt_logprobs=21)),
        ("logit_bias", dict(logit_bias={100: 1.0})),
        ("logit_bias", dict(logit_bias={-1: 1.0})),
        ("logit_bias", dict(logit_bias={3: 100.5})),
        ("stop_token_ids", dict(stop_token_ids=[5, 100])),
    ],
)
def test_rejects_out_of_range_values_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_token_ids_unchecked_against_vocab_when_size_unknown() -> None:
    SamplingParams(logit_bias={10**6: 1.0}, stop_token_ids=[10**6]).validate()
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-3]).validate()
