"""Bad input gets a clear error naming the knob, and the pipeline keeps working."""

from __future__ import annotations

import pytest
from conftest import MAX_PROMPT, make_pipe

from npuw_kv.model.source import ModelSourceError, resolve_model
from npuw_kv.model.variants import ModelLoadError
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.engine import CapacityError


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
