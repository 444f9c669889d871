"""Generation settings and token choice, without a model."""

from __future__ import annotations

import numpy as np
import openvino_genai
import pytest

from npuw_kv.api.config_checks import SIZE_MAX
from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.generation.sampling import Sampler

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


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
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"top_k": "abc"}, "top_k must be an integer"),
        ({"do_sample": "no"}, "do_sample must be True or False"),
        ({"ignore_eos": "False"}, "ignore_eos must be True or False"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"rng_seed": 1.5}, "rng_seed must be an integer"),
        ({"stop_strings": {""}}, "non-empty strings"),
        ({"stop_strings": {3}}, "stop_strings must be strings"),
        ({"stop_strings": 3}, "set of strings"),
    ],
)
def test_bad_generation_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**{"max_new_tokens": 8, **kwargs}).validate()


def test_numpy_numbers_and_a_single_stop_string_are_accepted():
    config = GenerationConfig(max_new_tokens=np.int64(5), top_k=np.int32(3), stop_strings="\n\n")
    assert config.max_new_tokens == 5 and type(config.max_new_tokens) is int
    assert config.stop_strings == {"\n\n"}  # one string, not its characters


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.08], np.float32))
    config = GenerationConfig(do_sample=True, min_p=0.2, rng_seed=0)  # keeps p >= 0.1
    sampler = Sampler(config)
    picks = [sampler.sample(logits) for _ in range(200)]
    assert {c.token for c in picks} == {0, 1, 2}
    # the log-prob is the sampled distribution's (as genai's without ``logprobs``)
    assert picks[0].logprob == pytest.approx(np.log([0.5, 0.3, 0.12][picks[0].token] / 0.92))


def test_penalties_follow_genai_formulas():
    from npuw_kv.generation.logits_process import LogitsProcessor

    config = GenerationConfig(presence_penalty=1.0, frequency_penalty=0.5, min_new_tokens=4)
    process = LogitsProcessor(GenerationConfig.build(config, eos_token_id=3), np.array([2]))
    for token in (0, 1, 1):
        process.accept(token)
    out = process(np.array([2.0, -2.0, 0.5, 9.0], np.float32))
    # presence then frequency, each toward zero: 2 -> 1 -> 0.5; -2 -> -1 -> 0 (genai's sign
    # rule); the prompt token 2 is untouched; EOS is masked before the 4th new token
    assert out.tolist() == [0.5, 0.0, 0.5, -np.inf]
    process.accept(2)
    assert process(np.zeros(4, np.float32))[3] == 0.0


def test_no_repeat_ngram_bans_what_would_repeat_an_ngram():
    from npuw_kv.generation.logits_process import LogitsProcessor

    rng = np.random.default_rng(0)
    for n in (1, 2, 3):
        for _ in range(20):
            history = rng.integers(0, 4, rng.integers(1, 12)).tolist()
            process = LogitsProcessor(GenerationConfig(no_repeat_ngram_size=n), np.array(history))
            grams = {tuple(history[i : i + n]) for i in range(len(history) - n + 1)}
            tail = tuple(history[len(history) - n + 1 :]) if n > 1 else ()
            want = {t for t in range(4) if (*tail, t) in grams} if len(history) >= n else set()
            assert set(process.banned_ngram_ends(n).tolist()) == want


def test_logprobs_report_raw_probabilities_and_the_top_tokens():
    logits = np.array([1.0, 3.0, 2.0, 0.0], np.float32)
    choice = Sampler(GenerationConfig(logprobs=2, repetition_penalty=2.0), np.array([1])).sample(
        logits
    )
    raw = logits - np.log(np.exp(logits).sum())
    assert choice.token == 2  # the penalty moved the choice, not the reported log-probs
    assert choice.logprob == pytest.approx(raw[2])
    assert [t for t, _ in choice.top] == [1, 2] and choice.top[0][1] == pytest.approx(raw[1])


def test_a_fully_masked_row_is_an_error_not_a_token():
    config = GenerationConfig(min_new_tokens=1, stop_token_ids={0, 1})
    with pytest.raises(RuntimeError, match="no token is allowed"):
        Sampler(config).sample(np.array([1.0, 2.0, -np.inf], np.float32))


def test_unset_fields_read_genais_sentinels_and_max_new_tokens_wins():
    """Every default is genai's, its "unset" sentinels included (None is taken for them)."""
    ours, theirs = GenerationConfig(), openvino_genai.GenerationConfig()
    for name in ("max_new_tokens", "max_length", "no_repeat_ngram_size", "top_k", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.stop_criteria == theirs.stop_criteria
    assert ours.new_token_budget(10) is None
    assert GenerationConfig(max_new_tokens=None).max_new_tokens == SIZE_MAX
    assert GenerationConfig(eos_token_id=None).eos_token_id == -1
    assert GenerationConfig(max_length=15).new_token_budget(10) == 5
    assert GenerationConfig(max_length=15, max_new_tokens=2).new_token_budget(10) == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_name_the_precision_settings(bad):
    """A NaN or +inf logit is an overflow in the model, not a choice: the sampler says so
    (naming no setting: it does not know which are set; the pipelines name those that would
    widen the values) and the next finite row samples again."""
    from npuw_kv.errors import NumericError

    sampler = Sampler(GenerationConfig(max_new_tokens=4))
    logits = np.zeros(8, np.float32)
    logits[3] = bad
    with pytest.raises(NumericError, match="NaN or \\+inf logits") as caught:
        sampler.sample(logits)
    assert "=" not in str(caught.value)
    assert sampler.sample(np.arange(8, dtype=np.float32)).token == 7
