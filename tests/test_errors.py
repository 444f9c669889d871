"""Bad input gets a clear error naming the knob, and the pipeline keeps working."""

from __future__ import annotations

import warnings

import pytest
from conftest import MAX_PROMPT, make_pipe

from npuw_kv import CapacityError, CompileError, LLMPipeline, ModelLoadError, ModelSourceError
from npuw_kv.model.source import resolve_model


@pytest.fixture(scope="module")
def pipe(smol_dir):
    return make_pipe(smol_dir, "CPU")


def test_prompt_longer_than_max_prompt_len(pipe, text_ids):
    too_long = text_ids(MAX_PROMPT + 5)
    with pytest.raises(CapacityError) as info:
        pipe.generate(too_long, max_new_tokens=2)
    message = str(info.value)
    assert str(MAX_PROMPT + 5) in message and str(MAX_PROMPT) in message
    assert "MAX_PROMPT_LEN" in message
    assert len(pipe.generate(text_ids(10), max_new_tokens=3, ignore_eos=True).tokens) == 3


def test_empty_prompt_and_bad_generation_settings(pipe, text_ids):
    with pytest.raises(ValueError, match="empty"):
        pipe.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown generation setting"):
        pipe.generate(text_ids(4), max_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        pipe.generate(text_ids(4), do_sample=True, top_p=0.0)
    assert len(pipe.generate(text_ids(10), max_new_tokens=2, ignore_eos=True).tokens) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_chunk_size": 0}, "PREFILL_CHUNK_SIZE"),
        ({"MIN_RESPONSE_LEN": 0}, "MIN_RESPONSE_LEN"),
        ({"device": "TPU"}, "unknown device"),
        ({"colour": "blue"}, "unknown setting"),
    ],
)
def test_invalid_pipeline_config(smol_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMPipeline(smol_dir, **kwargs)


def test_missing_and_corrupt_model_files(tmp_path, smol_dir):
    with pytest.raises(ModelSourceError, match="not found"):
        LLMPipeline(tmp_path / "nope")
    with pytest.raises(ModelSourceError, match="lacks openvino_model.xml"):
        LLMPipeline(tmp_path)
    for name in (
        "openvino_model.xml",
        "openvino_model.bin",
        "openvino_tokenizer.xml",
        "openvino_detokenizer.xml",
    ):
        (tmp_path / name).write_text("<not an IR")
    with pytest.raises(ModelLoadError, match="cannot read"):
        LLMPipeline(tmp_path)
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelSourceError, match="could not convert"):
        resolve_model(bad_gguf, cache_dir=tmp_path / "cache", log=lambda *a, **k: None)
    assert not list((tmp_path / "cache").glob("broken-*"))  # nothing half-written is cached


def test_token_ids_are_checked(pipe, text_ids):
    expected = pipe.generate(text_ids(10), max_new_tokens=3, ignore_eos=True).tokens
    bad = [
        ([-5, 1, 2], "outside the vocabulary"),
        ([10**6, 1, 2], r"1000000 is outside the vocabulary \[0, 49152\)"),
        ([1.7, 9690.2], "must be integers"),
        ([[1, 9690], [198, 5]], "one prompt at a time"),
        (5, "sequence of token ids"),
    ]
    for ids, message in bad:
        with pytest.raises(ValueError, match=message):
            pipe.generate(ids, max_new_tokens=2)
    tokenized = pipe.get_tokenizer().encode("Hello there")  # genai's TokenizedInputs
    result = pipe.generate(tokenized, max_new_tokens=2, ignore_eos=True)  # EncodedResults
    assert result.perf_metrics.get_num_input_tokens() > 1 and len(result.tokens[0]) == 2
    assert pipe.generate(text_ids(10), max_new_tokens=3, ignore_eos=True).tokens == expected


def test_a_broken_tokenizer_fails_before_compiling(tmp_path, smol_dir, monkeypatch):
    for item in smol_dir.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "openvino_tokenizer.xml").unlink()
    (tmp_path / "openvino_tokenizer.xml").write_text("<not an IR")
    for compile_ in ("compile_requests", "compile_paged"):
        monkeypatch.setattr(
            f"npuw_kv.runtime.build.{compile_}", lambda *a: pytest.fail("compiled first")
        )
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLMPipeline(tmp_path)


def test_a_property_the_device_refuses_is_a_compile_error(smol_dir, monkeypatch):
    """Refused as the settings' fault: no fallback to the static-shape path (whose warning
    would blame PagedAttention) and no second compile."""
    import npuw_kv.runtime.build as build_module

    monkeypatch.setattr(
        build_module, "compile_requests", lambda *a: pytest.fail("compiled the fallback")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CompileError, match="SNIPPETS_MODE='bogus'") as info:
            LLMPipeline(smol_dir, SNIPPETS_MODE="bogus", max_prompt_len=64, prefill_chunk_size=64)
    assert isinstance(info.value, ValueError)  # the CLI reports it like any bad setting


def test_an_npu_compile_error_names_the_settings_given(smol_dir):
    with pytest.raises(CompileError, match=r"NPU could not compile.*NPUW_FOLD='MAYBE'"):
        LLMPipeline(smol_dir, "NPU", NPUW_FOLD="MAYBE", max_prompt_len=64, prefill_chunk_size=64)


def test_an_unknown_npuw_device_is_named(smol_dir):
    with pytest.raises(ValueError, match=r"npuw_devices \(NPUW_DEVICES\).*'FOO'"):
        LLMPipeline(smol_dir, "NPU", npuw_devices="FOO")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('["a list"]', "holds a JSON list, not an object"),
        ('{"context_length": -256}', "context_length must be a positive integer, got -256"),
        ('{"context_length": "long"}', "context_length must be a positive integer"),
    ],
)
def test_a_damaged_source_info_names_the_file(smol_dir, tmp_path, text, message):
    """A cache entry's npuw_kv_source.json that is not what npuw-kv wrote: one ModelLoadError
    naming the file and saying the entry can be deleted, before anything compiles."""
    import shutil

    from npuw_kv.model.ir_cache import SOURCE_INFO

    entry = tmp_path / "entry"
    shutil.copytree(smol_dir, entry)
    (entry / SOURCE_INFO).write_text(text)
    with pytest.raises(ModelLoadError, match=message) as caught:
        LLMPipeline(entry, "CPU")
    assert SOURCE_INFO in str(caught.value)


def test_nan_logits_name_only_the_settings_that_would_remove_them(smol_dir, monkeypatch):
    """At exact f32 (compute, KV, no NPUW) no precision setting is left to name; with a
    narrower precision decided, exactly those settings are named."""
    from dataclasses import replace

    import numpy as np

    from npuw_kv.errors import NumericError

    pipe = make_pipe(smol_dir, "CPU", attention_backend="sdpa")  # exact f32, f32 KV
    nan = np.full(pipe.vocab_size, np.nan, np.float32)
    monkeypatch.setattr(pipe.runner, "prefill", lambda ids, on_chunk=None: nan)
    with pytest.raises(NumericError, match="no precision setting removes it") as caught:
        pipe.generate([1, 2, 3], max_new_tokens=2)
    assert "NPUW_F16IC" not in str(caught.value)
    decided = pipe.engine.decided
    narrow = replace(decided, compute_precision="bf16", kv_precision="u8", npuw_f16=True)
    monkeypatch.setattr(pipe.engine, "decided", narrow)
    with pytest.raises(NumericError) as caught:
        pipe.generate([1, 2, 3], max_new_tokens=2)
    for setting in ("NPUW_F16IC=NO", "INFERENCE_PRECISION_HINT=f32", "kv_precision='f32'"):
        assert setting in str(caught.value)
    # on NPU, NPUW's CPU sub-models compute in the CPU's precision (bf16 where it has it)
    from npuw_kv.config.decide import cpu_precision
    from npuw_kv.config.pipeline_config import PipelineConfig

    config = PipelineConfig.from_kwargs("NPU")
    on_npu = replace(pipe.engine.decided, config=config, npuw_devices="CPU")
    monkeypatch.setattr(pipe.engine, "decided", on_npu)
    with pytest.raises(NumericError) as caught:
        pipe.generate([1, 2, 3], max_new_tokens=2)
    named = "INFERENCE_PRECISION_HINT=f32" in str(caught.value)
    assert named is (cpu_precision(pipe.core, config) != "f32")
