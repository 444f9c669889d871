"""``GenerationConfig`` as openvino-genai's: built from keywords or a ``generation_config.json``,
its types checked then and its values by ``validate()`` (a RuntimeError, as genai's), with
``update_generation_config``, ``set_eos_token_id`` and the ``is_*`` predicates."""

from __future__ import annotations

import json

import openvino_genai
import pytest

from npuw_kv import GenerationConfig

pytestmark = pytest.mark.unit

# what genai's own validate() refuses, and each refusal's words here
INVALID = [
    ({}, "no stop condition"),
    ({"ignore_eos": True}, "ignore_eos=True needs max_new_tokens or max_length"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be > 0 \(0 only with echo=True\)"),
    ({"max_new_tokens": 1, "num_return_sequences": 0}, "num_return_sequences must be >= 1"),
    ({"stop_token_ids": {-1}}, "stop_token_ids must be >= 0"),
    ({"max_new_tokens": 1, "do_sample": True, "top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": 1, "num_assistant_tokens": 2, "num_beams": 2}, "runs one sequence"),
    ({"max_new_tokens": 1, "max_ngram_size": 1}, "needs num_assistant_tokens > 0"),
    (
        {"max_new_tokens": 1, "num_assistant_tokens": 2, "assistant_confidence_threshold": 0.5},
        "exclude each other",
    ),
]


@pytest.mark.parametrize(("fields", "message"), INVALID)
def test_values_are_checked_by_validate_not_when_built(fields, message):
    config = GenerationConfig(**fields)  # built: only types are checked
    with pytest.raises(RuntimeError, match=message):
        config.validate()
    theirs = openvino_genai.GenerationConfig()
    theirs.update_generation_config(**fields)
    with pytest.raises(RuntimeError):
        theirs.validate()  # genai refuses the same


def test_what_only_sampling_or_beams_read_is_not_checked_without_them():
    GenerationConfig(max_new_tokens=1, top_p=5.0, temperature=-1.0, min_p=2.0).validate()
    GenerationConfig(max_new_tokens=1, num_beam_groups=2, diversity_penalty=1.0).validate()


def test_an_eos_set_as_an_attribute_must_join_the_stop_tokens():
    config = GenerationConfig(max_new_tokens=4)
    config.eos_token_id = 7
    with pytest.raises(RuntimeError, match=r"must contain eos_token_id \(7\): set it with"):
        config.validate()
    config.set_eos_token_id(7)
    config.validate()
    assert config.stop_token_ids == {7} and config.stop_ids() == {7}


def test_update_and_predicates():
    config = GenerationConfig()
    config.update_generation_config(max_new_tokens=3, eos_token_id=2, num_beams=4)
    assert (config.max_new_tokens, config.stop_token_ids) == (3, {2})
    assert config.is_beam_search() and not config.is_greedy_decoding()
    config.update_generation_config(num_beams=1, do_sample=True)
    assert config.is_multinomial() and not config.is_beam_search()
    config.update_generation_config(do_sample=False, num_assistant_tokens=3, max_ngram_size=2)
    assert config.is_greedy_decoding() and config.is_prompt_lookup()
    assert config.is_assisting_generation() and not config.is_tree_search()
    with pytest.raises(ValueError, match=r"unknown generation setting\(s\) \['beams'\]"):
        config.update_generation_config(beams=2)


def test_built_from_a_generation_config_json(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(
        json.dumps(
            {"eos_token_id": [2, 32000], "max_new_tokens": 9, "do_sample": True,
             "temperature": 0.6, "early_stopping": True, "transformers_version": "4.50"}
        )
    )  # fmt: skip
    config = GenerationConfig(path, top_k=5)
    assert (config.eos_token_id, config.stop_token_ids) == (2, {2, 32000})
    assert (config.max_new_tokens, config.do_sample, config.top_k) == (9, True, 5)
    theirs = openvino_genai.GenerationConfig(str(path))
    assert config.temperature == pytest.approx(0.6)
    assert config.stop_criteria == theirs.stop_criteria == openvino_genai.StopCriteria.EARLY
    assert (theirs.eos_token_id, theirs.stop_token_ids) == (2, {2, 32000})
    with pytest.raises(ValueError, match="generation config .* not readable JSON"):
        (tmp_path / "bad.json").write_text("{")
        GenerationConfig(tmp_path / "bad.json")


def test_a_lone_surrogate_in_a_stop_string_is_named():
    with pytest.raises(ValueError, match=r"stop string '\\ud800' is not valid Unicode"):
        GenerationConfig(stop_strings={"\ud800"})
