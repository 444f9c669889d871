"""Structured output (issue #16): genai's StructuredOutputConfig as an xgrammar logits mask."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import openvino_genai
import pytest

from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.generation.decode import generate_tokens
from npuw_kv.generation.grammar import grammar_source
from npuw_kv.generation.logits_process import LogitsConstraint
from npuw_kv.generation.structured import GrammarConstraint, _backend, constraint_for, vocab_type_of

SOC = openvino_genai.StructuredOutputConfig
VOCAB = 49152  # SmolLM2's tokenizer and model
EOS = 2  # <|im_end|>
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def ids_of(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in np.asarray(encoded.input_ids.data).reshape(-1)]


def feed(constraint: GrammarConstraint, tokenizer, text: str) -> bool:
    """Accept ``text`` as the tokenizer splits it; whether the grammar is then done."""
    for token in ids_of(tokenizer, text):
        constraint.accept(token)
    return constraint.done()


def check_person(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age"}
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


# -- the constraint driven with logits we make -------------------------------------------------


def test_regex_masks_to_digits_and_ends_after_three(smol_tokenizer):
    constraint = constraint_for(SOC(regex="[0-9]{3}"), smol_tokenizer, VOCAB, EOS)
    assert isinstance(constraint, LogitsConstraint)
    vocab = _backend(smol_tokenizer, VOCAB).vocab
    digits = [vocab.index(str(d).encode()) for d in range(10)]
    logits = np.linspace(5.0, -5.0, VOCAB, dtype=np.float32)  # the lowest ids score best
    for step in range(3):
        assert not constraint.done()
        masked = constraint.apply(logits)
        assert masked.dtype == np.float32 and masked is not logits
        assert sorted(np.flatnonzero(np.isfinite(masked))) == digits  # exactly the ten digits
        assert np.array_equal(masked[digits], logits[digits])
        token = int(np.argmax(masked))
        assert vocab[token] == b"0"
        if step == 1:
            with pytest.raises(ValueError, match=r"token 1 .*not allowed by the grammar after '0'"):
                constraint.accept(1)  # <|im_start|>: a special token, never allowed
            with pytest.raises(ValueError, match="not allowed"):
                constraint.accept(ids_of(smol_tokenizer, "a")[0])
        constraint.accept(token)
    assert constraint.done()  # complete, and only the stop token may follow
    assert np.flatnonzero(np.isfinite(constraint.apply(logits))).tolist() == [EOS]
    with pytest.raises(ValueError, match="not allowed by the grammar after '000'"):
        constraint.accept(digits[5])
    constraint.accept(EOS)
    assert constraint.done()
    with pytest.raises(ValueError, match="after the grammar ended"):
        constraint.accept(EOS)


def test_model_vocab_wider_than_tokenizer(smol_tokenizer):
    """Padding rows of the LM head (model vocab > tokenizer vocab) are never allowed."""
    wide = VOCAB + 64
    constraint = constraint_for(SOC(regex="[a-z]+"), smol_tokenizer, wide, EOS)
    assert constraint is not None
    masked = constraint.apply(np.zeros(wide, np.float32))
    assert masked.shape == (wide,) and not np.isfinite(masked[VOCAB:]).any()
    assert np.isfinite(masked[:VOCAB]).sum() > 100
    with pytest.raises(ValueError, match=f"one row of {wide} logits"):
        constraint.apply(np.zeros(VOCAB, np.float32))
    with pytest.raises(ValueError, match="not allowed"):
        constraint.accept(VOCAB + 3)


def test_special_tokens_are_not_text(smol_tokenizer):
    """<|im_start|> and friends spell as text in the vocabulary but are never allowed inside a
    grammar; the stop token only where the grammar may end."""
    constraint = constraint_for(SOC(regex="[^0-9]*"), smol_tokenizer, VOCAB, EOS)
    assert constraint is not None
    allowed = constraint.allowed()
    assert not allowed[[0, 1, 3, 16]].any()
    assert allowed[EOS]  # the empty string matches: it may stop at once
    assert vocab_type_of(_backend(smol_tokenizer, VOCAB).vocab) == "RAW"  # byte-level BPE


def test_vocab_type_detection():
    assert vocab_type_of([b"a", b" the", b"\xa1"]) == "RAW"
    sentencepiece = [b"<unk>", b"<0x0A>", "▁the".encode(), "▁a".encode(), b"b"]
    assert vocab_type_of(sentencepiece) == "BYTE_FALLBACK"
    assert vocab_type_of(["Ġthe".encode(), "Ġa".encode(), b"b"]) == "BYTE_LEVEL"


def test_every_genai_form(smol_tokenizer):
    schema = json.dumps(PERSON)

    def make(**field):
        constraint = constraint_for(SOC(**field), smol_tokenizer, VOCAB, [EOS])
        assert constraint is not None
        return constraint

    assert feed(make(json_schema=schema), smol_tokenizer, '{"name": "Bob", "age": 3}')
    assert feed(make(grammar='root ::= "yes" | "no"'), smol_tokenizer, "no")
    tag = SOC.Tag("<f>", SOC.JSONSchema(schema), "</f>")
    triggered = make(structural_tags_config=SOC.TriggeredTags(["<f"], [tag]))
    assert not feed(triggered, smol_tokenizer, 'hi <f>{"name": "A", "age": 1}</f> more')
    with pytest.raises(ValueError, match="not allowed"):  # inside the tag the schema holds
        feed(
            make(structural_tags_config=SOC.TriggeredTags(["<f"], [tag])),
            smol_tokenizer,
            'x <f>{"age": "',
        )
    old = openvino_genai.StructuralTagsConfig(
        structural_tags=[openvino_genai.StructuralTagItem(begin="<f>", schema=schema, end="</f>")],
        triggers=["<f"],
    )
    assert not feed(
        make(structural_tags_config=old), smol_tokenizer, 'x <f>{"name": "A", "age": 1}</f>'
    )
    concat = SOC.ConstString("id-") + SOC.Regex("[0-9]{2}")
    assert feed(make(structural_tags_config=concat), smol_tokenizer, "id-42")
    union = SOC.Union(SOC.ConstString("yes"), SOC.EBNF('root ::= "n" "o"+'))
    assert not feed(make(compound_grammar=union), smol_tokenizer, "noo")  # more o's may come
    assert feed(make(compound_grammar=union), smol_tokenizer, "yes")
    separated = SOC.TagsWithSeparator([SOC.Tag("<a>", SOC.Regex("[0-9]"), "</a>")], ";", True)
    assert not feed(make(structural_tags_config=separated), smol_tokenizer, "<a>1</a>;<a>2</a>")
    qwen = SOC.QwenXMLParametersFormat(json.dumps({"type": "object", "properties": {}}))
    make(structural_tags_config=SOC.Tag("<tool>", qwen, "</tool>"))
    raw = {"type": "structural_tag", "format": {"type": "regex", "pattern": "[ab]+"}}
    assert not feed(make(structural_tags_config=json.dumps(raw)), smol_tokenizer, "abba")
    assert SOC.Concat(SOC.AnyText(), SOC.ConstString("!")).elements  # AnyText converts too
    kind, text = grammar_source(SOC(structural_tags_config=SOC.Concat(SOC.AnyText(), tag)))
    assert kind == "structural_tag"
    assert json.loads(text) == {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "any_text"},
                {
                    "type": "tag",
                    "begin": "<f>",
                    "content": {"type": "json_schema", "json_schema": PERSON},
                    "end": "</f>",
                },
            ],
        },
    }


def test_rejected_grammars_raise_value_error_with_xgrammar_message(smol_tokenizer):
    def build(config):
        return constraint_for(config, smol_tokenizer, VOCAB, EOS)

    with pytest.raises(ValueError, match=r'JSON schema: Unsupported type "nonsense"'):
        build(SOC(json_schema='{"type": "nonsense"}'))
    with pytest.raises(ValueError, match="JSON schema: Failed to parse JSON"):
        build(SOC(json_schema="{not json"))
    with pytest.raises(ValueError, match="regex: Regex parsing error at position 5: Unclosed"):
        build(SOC(regex="[0-9"))
    with pytest.raises(ValueError, match='EBNF grammar: .*Rule "foo" is not defined'):
        build(SOC(grammar="root ::= foo"))
    bad_tag = {"type": "structural_tag", "format": {"type": "nope"}}
    with pytest.raises(ValueError, match="structural tag: .*not recognized: nope"):
        build(SOC(structural_tags_config=json.dumps(bad_tag)))
    with pytest.raises(ValueError, match="JSONSchema is not valid JSON"):
        build(SOC(compound_grammar=SOC.JSONSchema("{bad")))
    with pytest.raises(ValueError, match="exactly one of"):
        build(SimpleNamespace(json_schema="{}", regex="a"))
    with pytest.raises(ValueError, match="exactly one of"):
        build(SOC())
    assert constraint_for(None, smol_tokenizer, VOCAB, EOS) is None


def test_tokenizer_info_built_once(smol_tokenizer):
    first = _backend(smol_tokenizer, VOCAB)
    start = time.perf_counter()
    for _ in range(5):
        constraint_for(SOC(json_schema=json.dumps(PERSON)), smol_tokenizer, VOCAB, EOS)
    assert time.perf_counter() - start < 0.5  # no vocabulary rebuilt per call
    assert _backend(smol_tokenizer, VOCAB) is first


def test_missing_xgrammar_names_the_install(smol_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'npuw-kv\[structured\]'"):
        constraint_for(SOC(regex="a"), smol_tokenizer, VOCAB, EOS)
    assert constraint_for(None, smol_tokenizer, VOCAB, EOS) is None  # not needed without one


# -- real generation on SmolLM2 ----------------------------------------------------------------

PROMPTS = [
    "Give me a JSON object describing a person with a name and an age.",
    "Why is the sky blue?",  # an answer that is not JSON at all unless forced
]


def test_generation_follows_the_schema_as_genai_does(f32_pipe, smol_dir):
    soc = SOC(json_schema=json.dumps(PERSON))
    reference = openvino_genai.LLMPipeline(
        str(smol_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32
    )
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=60, structured_output_config=soc, eos_token_id=EOS)
        constraint = constraint_for(soc, f32_pipe.tokenizer, f32_pipe.vocab_size, config.stop_ids())
        ids = f32_pipe.encode(prompt)
        result = generate_tokens(
            f32_pipe.runner, f32_pipe.tokenizer, ids, config, None, constraint=constraint
        )
        assert result.finish_reason == "stop"
        check_person(json.loads(result.text))
        genai_config = openvino_genai.GenerationConfig()
        genai_config.max_new_tokens = 60
        genai_config.structured_output_config = soc
        assert result.text == str(reference.generate(prompt, genai_config))
    del reference


def test_sampled_generation_stays_in_the_grammar(f32_pipe):
    """Temperature / top-k / top-p / repetition penalty over the masked logits: still JSON."""
    soc = SOC(json_schema=json.dumps(PERSON))
    ids = f32_pipe.encode(PROMPTS[0])
    for seed in range(2):
        config = GenerationConfig(
            max_new_tokens=80,
            structured_output_config=soc,
            eos_token_id=EOS,
            do_sample=True,
            top_k=50,
            top_p=0.95,
            repetition_penalty=1.1,
            rng_seed=seed,
        )
        constraint = constraint_for(soc, f32_pipe.tokenizer, f32_pipe.vocab_size, config.stop_ids())
        result = generate_tokens(
            f32_pipe.runner, f32_pipe.tokenizer, ids, config, None, constraint=constraint
        )
        assert result.finish_reason == "stop"
        check_person(json.loads(result.text))
    regex = SOC(regex="[0-9]{3}")  # done() ends it even when no stop token may (ignore_eos)
    config = GenerationConfig(
        max_new_tokens=20, structured_output_config=regex, eos_token_id=EOS, ignore_eos=True
    )
    constraint = constraint_for(regex, f32_pipe.tokenizer, f32_pipe.vocab_size, config.stop_ids())
    result = generate_tokens(
        f32_pipe.runner, f32_pipe.tokenizer, ids, config, None, constraint=constraint
    )
    assert result.finish_reason == "stop" and len(result.tokens) == 3 and result.text.isdigit()


def test_grammar_times_are_in_the_metrics_as_genai_reports_them(f32_pipe):
    """get_grammar_compiler_init_times: µs the grammar backend took to set up, by backend;
    get_grammar_compile_time: each sequence's grammar compile, in ms (min <= mean <= max)."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    soc = openvino_genai.StructuredOutputConfig(json_schema=schema)
    out = f32_pipe.generate(["Give JSON.", "More JSON."], max_new_tokens=6,
                            structured_output_config=soc)  # fmt: skip
    metrics = out.perf_metrics
    init = metrics.get_grammar_compiler_init_times()
    assert set(init) == {"xgrammar"} and init["xgrammar"] > 0
    assert len(metrics.raw_metrics.grammar_compile_times) == 2
    stats = metrics.get_grammar_compile_time()
    assert 0 < stats.min <= stats.mean <= stats.max
    plain = f32_pipe.generate("Hi", max_new_tokens=2).perf_metrics
    assert plain.get_grammar_compiler_init_times() == {}
    assert plain.get_grammar_compile_time().mean == -1
