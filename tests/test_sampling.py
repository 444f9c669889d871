"""Generation settings and token choice, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.sampling import GenerationConfig, Sampler


def test_top_k_1_is_greedy_even_on_tied_logits():
    """bf16 logits tie often; top_k=1 must keep exactly one token, argmax's."""
    logits = np.zeros(100, np.float32)
    logits[[17, 42, 80]] = 25.875  # a three-way tie at the top
    greedy = Sampler(GenerationConfig())(logits)
    for seed in range(20):
        config = GenerationConfig(do_sample=True, top_k=1, rng_seed=seed)
        assert Sampler(config)(logits) == greedy == 17


def test_top_k_keeps_exactly_k_tokens():
    logits = np.array([5.0, 5.0, 5.0, 5.0, 1.0], np.float32)
    picks = {
        Sampler(GenerationConfig(do_sample=True, top_k=2, rng_seed=s))(logits) for s in range(64)
    }
    assert picks == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": "abc"}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": None}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"top_k": "abc"}, "top_k must be an integer"),
        ({"do_sample": "no"}, "do_sample must be True or False"),
        ({"ignore_eos": "False"}, "ignore_eos must be True or False"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"rng_seed": 1.5}, "rng_seed must be an integer"),
        ({"stop_strings": {""}}, "non-empty strings"),
        ({"stop_strings": {3}}, "non-empty strings"),
        ({"stop_strings": 3}, "set of strings"),
    ],
)
def test_bad_generation_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_numpy_numbers_and_a_single_stop_string_are_accepted():
    config = GenerationConfig(max_new_tokens=np.int64(5), top_k=np.int32(3), stop_strings="\n\n")
    assert config.max_new_tokens == 5 and type(config.max_new_tokens) is int
    assert config.stop_strings == {"\n\n"}  # one string, not its characters
