"""SamplingParams: vLLM's defaults, normalisation, and errors that name the parameter."""

from __future__ import annotations

import math

import pytest

from pagoda.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logit_bias is None
    assert p.sampling_type == SamplingType.RANDOM


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9), top_k=-1, logit_bias={"5": 2, 6: -1.5})
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert p.top_k == 0
    assert p.logit_bias == {5: 2.0, 6: -1.5}
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_greedy_switches_truncation_off() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"n": 2, "best_of": 4}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1e-3},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"logit_bias": {0: -100, 1: 100}},
        {"n": 3, "best_of": 3},
        {"best_of": 1},
    ],
)
def test_valid_edge_values(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_verify_token_ids() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).verify_token_ids(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify_token_ids(10)


def test_helpers() -> None:
    p = SamplingParams(stop=["a", "abcd"], stop_token_ids=[5])
    assert p.output_text_buffer_length == 3
    p_incl = SamplingParams(stop=["abcd"], include_stop_str_in_output=True)
    assert p_incl.output_text_buffer_length == 0
    assert p.all_stop_token_ids({2}) == {2, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids({2}) == {5}


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], logit_bias={1: 1.0}, seed=4)
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.logit_bias[2] = 2.0
    assert p.stop == ["x"] and p.logit_bias == {1: 1.0}


@pytest.mark.parametrize(("seed", "n"), [(2**64, 1), (2**63, 1), (2**63 - 1, 2), (-(2**63) - 1, 1)])
def test_seed_out_of_the_generators_range_is_refused(seed: int, n: int) -> None:
    with pytest.raises(ValueError, match="^seed"):
        SamplingParams(seed=seed, n=n)


def test_seed_at_the_edges_of_the_range_is_accepted() -> None:
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
