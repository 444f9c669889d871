"""Every field of openvino_genai.GenerationConfig: honoured as genai honours it, or refused.

Behaviour is checked against genai's own CPU pipeline on SmolLM2, both exact f32 (greedy, few
tokens), running the same config (ours converted with ``to_genai``).  genai returns the stop
token that ended a sequence in its tokens; npuw_kv leaves it out (as it does EOS).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import openvino as ov
import openvino_genai
import pytest

from npuw_kv.api.generation_config import SIZE_MAX, GenerationConfig
from npuw_kv.generation.decode import generate_sequences, generate_tokens
from npuw_kv.generation.logits_process import LogitsConstraint, log_softmax

COUNT = "Count: 1, 2, 3, 4, 5, 6,"


@pytest.fixture(scope="module")
def both(f32_pipe, genai_f32_pipe):
    """``both(prompt, **settings)``: (genai's tokens or text, ours: GenerationResult); a
    prompt given as token ids gives genai's tokens, text gives its text."""

    def run(prompt, **settings):
        config = GenerationConfig.build(f32_pipe.get_generation_config(), **settings)
        if isinstance(prompt, str):
            return genai_f32_pipe.generate([prompt], config.to_genai()).texts[0], f32_pipe.generate(
                prompt, config
            )
        theirs = genai_f32_pipe.generate(ov.Tensor(np.array([prompt], np.int64)), config.to_genai())
        return ([int(t) for t in theirs.tokens[0]], theirs.scores[0]), f32_pipe.generate(
            np.array(prompt, np.int64), config
        )

    return run


@pytest.fixture(scope="module")
def yes_ids(f32_pipe):
    return f32_pipe.encode("Say only the word yes.").tolist()  # the answer ends at EOS early


@pytest.fixture(scope="module")
def count_ids(f32_pipe):
    return f32_pipe.encode(COUNT, template=False).tolist()


def genai_fields() -> set[str]:
    config = openvino_genai.GenerationConfig()
    return {n for n in dir(config) if not n.startswith("_") and not callable(getattr(config, n))}


# -- the config ---------------------------------------------------------------------------------
def test_every_genai_field_is_ours_with_genai_defaults():
    assert {f.name for f in fields(GenerationConfig)} == genai_fields()
    assert GenerationConfig.from_genai(openvino_genai.GenerationConfig()) == GenerationConfig()
    theirs, ours = openvino_genai.GenerationConfig(), GenerationConfig().to_genai()
    for name in genai_fields():
        assert getattr(ours, name) == getattr(theirs, name), name


def test_round_trip_of_every_field_through_genai():
    ours = GenerationConfig(
        max_new_tokens=9,
        max_length=50,
        min_new_tokens=2,
        ignore_eos=True,
        eos_token_id=2,
        stop_token_ids={7, 8},
        stop_strings={"x"},
        include_stop_str_in_output=True,
        echo=True,
        logprobs=3,
        num_return_sequences=2,
        apply_chat_template=False,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        no_repeat_ngram_size=3,
        do_sample=True,
        temperature=0.5,
        top_k=7,
        top_p=0.75,
        min_p=0.25,
        rng_seed=11,
    )
    assert ours.stop_token_ids == {2, 7, 8}  # EOS joins the stop tokens, as in genai
    theirs = ours.to_genai()
    theirs.validate()
    assert GenerationConfig.from_genai(theirs) == ours == GenerationConfig.build(theirs)
    again = GenerationConfig.from_genai(theirs).to_genai()
    for name in genai_fields() - {"structured_output_config", "adapters"}:
        assert getattr(again, name) == getattr(theirs, name), name
    assert GenerationConfig.build(ours, top_k=0).to_genai().top_k == 0  # kept as given
    assert GenerationConfig().to_genai().top_k == SIZE_MAX == GenerationConfig().top_k


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("parsers", [openvino_genai.Llama3JsonToolParser()], "parsers"),
        ("return_omni_outputs", True, "omni"),
        ("pruning_ratio", 30, "CDPruner"),
        ("relevance_weight", 0.9, "CDPruner"),
    ],
)
def test_unsupported_fields_are_refused_by_name(name, value, reason):
    with pytest.raises(ValueError, match=f"{name}=.*{reason}"):
        GenerationConfig(max_new_tokens=4, **{name: value}).validate()
    theirs = openvino_genai.GenerationConfig()
    theirs.max_new_tokens = 4
    setattr(theirs, name, value)
    with pytest.raises(ValueError, match=name):
        GenerationConfig.build(theirs).validate()


@pytest.mark.parametrize(
    "fields",
    [
        {"tree_depth": 2, "num_assistant_tokens": 5, "branching_factor": 3},
        {"tree_depth": 2, "num_assistant_tokens": 5, "do_sample": True},
        {"tree_depth": 2, "num_assistant_tokens": 5, "num_beams": 2},
        {"tree_depth": 2, "num_assistant_tokens": 5, "branching_factor": 0},
        {"tree_depth": 3, "num_assistant_tokens": 2},
        {"tree_depth": 2},
        {"tree_depth": 0, "branching_factor": 4},
    ],
)
def test_tree_search_fields_validate_as_genai(fields):
    """Tree search's rules (npuw_kv/generation/draft_tree.py) are genai's: a config is refused
    by ``validate()`` exactly when genai's refuses it."""
    theirs = openvino_genai.GenerationConfig()
    theirs.max_new_tokens = 4
    for name, value in fields.items():
        setattr(theirs, name, value)
    try:
        theirs.validate()
        refused = False
    except RuntimeError:
        refused = True
    ours = GenerationConfig(max_new_tokens=4, **fields)
    if refused:
        with pytest.raises(ValueError):
            ours.validate()
    else:
        ours.validate()
    assert ours.is_tree_search() == theirs.is_tree_search()


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_assistant_tokens", 5), ("assistant_confidence_threshold", 0.4)],
)
def test_assisted_fields_without_a_speculative_pipeline_decode_plainly(
    f32_pipe, count_ids, name, value
):
    """Assisted generation is honoured by a pipeline made with prompt_lookup / draft_model
    (tests/test_speculative.py); any other decodes as without the field, as genai does (its
    speculation changes no token), and says by name that the field has no effect."""
    assert getattr(GenerationConfig(**{name: value}), name) == value
    ids = np.array(count_ids)
    plain = f32_pipe.generate(ids, max_new_tokens=4, ignore_eos=True).tokens
    with pytest.warns(RuntimeWarning, match=f"{name}=.*has no effect.*prompt_lookup=True"):
        tokens = f32_pipe.generate(ids, max_new_tokens=4, ignore_eos=True, **{name: value}).tokens
    assert tokens == plain and len(tokens) == 4


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_return_sequences": 2}, "num_return_sequences=2 needs do_sample"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"do_sample": True, "min_p": 1.0}, r"min_p must be in \[0, 1\) when sampling"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens .5. must be <= max_new"),
        ({"stop_token_ids": {-3}}, r"stop_token_ids must be >= 0, got -3"),
        ({"stop_token_ids": {2**64}}, "stop_token_ids must be token ids"),
        ({"eos_token_id": 2**64}, f"eos_token_id must be <= {2**63 - 1}"),
        ({"rng_seed": 2**64}, f"rng_seed must be <= {2**64 - 1}"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"echo": "yes"}, "echo must be True or False"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"do_sample": True, "temperature": float("inf")}, "temperature must be a finite"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"min_p": float("-inf")}, "min_p must be a finite number"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
        ({"length_penalty": float("inf")}, "length_penalty must be a finite number"),
    ],
)
def test_bad_values_name_the_field(settings, message):
    """Types when the config is built, values when it is validated (as genai's)."""
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**{"max_new_tokens": 8, **settings}).validate()


def test_calls_asking_for_absurd_numbers_of_sequences_are_refused(f32_pipe):
    """Each sequence is held until the call ends: a call may ask for 1024 at most, and a beam
    search for no more beams than one step runs (max_num_seqs)."""
    with pytest.raises(ValueError, match="at most 1024: split the call"):
        f32_pipe.generate(["a", "b"], do_sample=True, num_return_sequences=600)
    with pytest.raises(ValueError, match=r"at most max_num_seqs \(16\)"):
        f32_pipe.generate("a", num_beams=17, max_new_tokens=2)
    assert f32_pipe.generate("a", max_new_tokens=2).tokens


def test_a_genai_config_drives_generate(f32_pipe, count_ids):
    theirs = openvino_genai.GenerationConfig()
    theirs.max_new_tokens, theirs.ignore_eos, theirs.no_repeat_ngram_size = 4, True, 2
    result = f32_pipe.generate(np.array(count_ids), theirs)
    assert len(result.tokens) == 4
    assert result.tokens != f32_pipe.generate(np.array(count_ids), max_new_tokens=4).tokens


# -- fields that change the output as genai's do ------------------------------------------------
def test_stop_tokens_and_min_new_tokens_match_genai(both, yes_ids):
    (theirs, _), ours = both(yes_ids, max_new_tokens=20)
    assert ours.finish_reason == "stop" and theirs == [*ours.tokens, 2]  # EOS
    (theirs, _), longer = both(yes_ids, max_new_tokens=20, min_new_tokens=len(ours.tokens) + 3)
    assert theirs[: len(longer.tokens)] == longer.tokens and len(longer.tokens) > len(ours.tokens)
    stop = ours.tokens[1]
    (theirs, _), cut = both(yes_ids, max_new_tokens=20, stop_token_ids={stop})
    assert cut.finish_reason == "stop" and theirs == [*cut.tokens, stop] == ours.tokens[:2]


@pytest.mark.parametrize(
    "settings",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    ],
)
def test_presence_and_frequency_penalties_match_genai(both, f32_pipe, settings):
    ids = f32_pipe.encode("Repeat the word hello ten times.").tolist()
    plain = f32_pipe.generate(np.array(ids), max_new_tokens=10, ignore_eos=True)
    (theirs, _), ours = both(ids, max_new_tokens=10, ignore_eos=True, **settings)
    assert ours.tokens == theirs != plain.tokens


def test_max_length_and_stop_strings_in_output_match_genai(both, f32_pipe, count_ids):
    (theirs, _), ours = both(count_ids, max_length=len(count_ids) + 4)
    assert ours.tokens == theirs and len(theirs) == 4 and ours.finish_reason == "length"
    (theirs, _), ours = both(count_ids, max_length=len(count_ids) + 9, max_new_tokens=2)
    assert ours.tokens == theirs and len(theirs) == 2  # max_new_tokens wins
    for stop in ("8,", " 8"):
        (theirs, _), ours = both(
            count_ids, max_new_tokens=12, stop_strings={stop}, include_stop_str_in_output=True
        )
        assert ours.tokens == theirs and ours.text.endswith(stop) and ours.finish_reason == "stop"
    with pytest.raises(ValueError, match="max_length .* must be greater than the prompt"):
        f32_pipe.generate(np.array(count_ids), max_length=len(count_ids))  # genai refuses it too


def test_echo_matches_genai_and_streams_the_prompt(both, f32_pipe):
    for prompt, template in ((COUNT, False), ("Say only yes.", True)):
        theirs, ours = both(prompt, max_new_tokens=5, echo=True, apply_chat_template=template)
        assert ours.text == theirs and len(ours.tokens) == 5
    streamed: list[str] = []
    result = f32_pipe.generate(
        COUNT, max_new_tokens=3, echo=True, apply_chat_template=False, streamer=streamed.append
    )
    assert result.text.startswith(COUNT) and "".join(streamed) == result.text


def test_logprobs_are_genai_scores(both, f32_pipe, yes_ids):
    (theirs, score), ours = both(yes_ids, max_new_tokens=20, logprobs=3)
    assert ours.tokens == theirs[:-1] and score < -1
    assert ours.score == pytest.approx(score, abs=0.02)  # both count the EOS that stopped it
    assert ours.score < sum(ours.logprobs) < 0  # EOS had a log-prob too
    first = log_softmax(ours.first_logits)
    assert ours.logprobs[0] == pytest.approx(first[ours.tokens[0]], abs=1e-6)
    assert [t for t, _ in ours.top_logprobs[0]] == list(np.argsort(-first)[:3])
    (_, score), plain = both(yes_ids, max_new_tokens=3)
    assert score == plain.score == 0.0 and plain.top_logprobs == []  # greedy scores nothing


def test_no_repeat_ngram_size_keeps_ngrams_unique(f32_pipe, count_ids):
    """genai applies no_repeat_ngram_size in beam search only; here in every mode (as HF)."""
    plain = f32_pipe.generate(np.array(count_ids), max_new_tokens=8, ignore_eos=True)
    ours = f32_pipe.generate(
        np.array(count_ids), max_new_tokens=8, ignore_eos=True, no_repeat_ngram_size=2
    )
    full = count_ids + ours.tokens
    pairs = list(zip(full, full[1:], strict=False))
    new = pairs[len(count_ids) - 1 :]  # each ends with a generated token
    assert all(pair not in pairs[: len(count_ids) - 1 + i] for i, pair in enumerate(new))
    assert ours.tokens != plain.tokens


# -- sampling, several sequences, constraints ---------------------------------------------------
def test_num_return_sequences_are_independent_and_seeded(f32_pipe, yes_ids):
    ids = np.array(yes_ids)
    config = GenerationConfig(
        max_new_tokens=6, ignore_eos=True, do_sample=True, num_return_sequences=3, rng_seed=5
    )
    runs = [generate_sequences(f32_pipe.runner, f32_pipe.tokenizer, ids, config) for _ in range(2)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]  # seeded
    assert len(runs[0]) == 3 and len({tuple(r.tokens) for r in runs[0]}) > 1
    assert all(r.score < 0 and len(r.logprobs) == 6 for r in runs[0])  # sampled: scored
    with pytest.raises(ValueError, match="a streamer takes one sequence"):
        generate_sequences(f32_pipe.runner, f32_pipe.tokenizer, ids, config, streamer=print)
    one = GenerationConfig.build(config, num_return_sequences=1, rng_seed=0)
    default = GenerationConfig.build(one, rng_seed=GenerationConfig().rng_seed)
    assert (
        f32_pipe.generate(ids, one).tokens == f32_pipe.generate(ids, default).tokens
    )  # genai: seed 0


class Spell:
    """A fake structured-output constraint: exactly ``tokens``, then done."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at = tokens, 0

    def apply(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[self.tokens[self.at]] = logits[self.tokens[self.at]]
        return out

    def accept(self, token: int) -> None:
        assert token == self.tokens[self.at]
        self.at += 1

    def done(self) -> bool:
        return self.at == len(self.tokens)


def test_a_constraint_steers_and_ends_generation(f32_pipe, yes_ids):
    ids, want = np.array(yes_ids), [2822, 11, 2822]
    assert isinstance(Spell(want), LogitsConstraint)
    for do_sample in (False, True):
        config = GenerationConfig(max_new_tokens=10, do_sample=do_sample, logprobs=1)
        result = generate_tokens(
            f32_pipe.runner, f32_pipe.tokenizer, ids, config, None, None, Spell(want)
        )
        assert result.tokens == want and result.finish_reason == "stop"
    config = GenerationConfig(max_new_tokens=10, structured_output_config=object())
    with pytest.raises(ValueError, match="structured_output_config"):
        generate_tokens(f32_pipe.runner, f32_pipe.tokenizer, ids, config, None)
