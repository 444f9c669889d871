"""Long prompts: the shapes the NPU path picks for a 16k prompt, and the errors a user meets on
the way there, each naming the setting to change (docs/measurements.md, "A 16k-token prompt")."""

from __future__ import annotations

import openvino as ov
import pytest
from conftest import MAX_PROMPT

from npuw_kv import CapacityError, UsageError
from npuw_kv.config.decide import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.runtime.shapes import static_shapes

LLAMA_CONTEXT = (131072, "config.json max_position_embeddings")  # Llama-3.2-1B's


@pytest.mark.unit
def test_a_16k_prompt_on_the_npu_path_needs_max_prompt_len_only():
    """At the NPU defaults a 16000-token prompt needs ``max_prompt_len`` alone: rounded up to
    whole chunks, KV for it and MIN_RESPONSE_LEN, and the lean ladders keep two models per
    phase (two more prefill rungs at 16k took ~6 % off TTFT for +665 MB peak RSS on the 1B
    stand-in: docs/measurements.md)."""
    config = PipelineConfig.from_kwargs("NPU", max_prompt_len=16000)
    assert config.max_prompt_len == 16128
    capacity = config.kv_capacity(LLAMA_CONTEXT)
    assert capacity == 16128 + config.min_response_len
    shapes = static_shapes(decide(ov.Core(), config), capacity)
    assert shapes.prefill_pasts == (7680, 15872)
    assert shapes.generate_pasts == (1280, 16255)


@pytest.mark.unit
def test_max_prompt_len_beyond_the_trained_context_names_the_longest_that_fits():
    config = PipelineConfig.from_kwargs("NPU", max_prompt_len=16000)
    with pytest.raises(UsageError) as info:
        config.kv_capacity((8192, "config.json max_position_embeddings"))
    message = str(info.value)
    assert "trained context of 8192 positions" in message
    assert "max_prompt_len (MAX_PROMPT_LEN / NPUW_LLM_MAX_PROMPT_LEN) to at most 8192" in message
    assert "16000 rounded up" in message  # the value given, not only the rounded one


@pytest.mark.npu_path
def test_a_prompt_past_max_prompt_len_names_the_setting_on_every_path(any_pipe, text_ids):
    """The NPU path too: the error says which setting to raise and to what; the pipeline then
    takes a prompt that fits."""
    with pytest.raises(CapacityError) as info:
        any_pipe.generate(text_ids(MAX_PROMPT + 300), max_new_tokens=1)
    message = str(info.value)
    assert f"prompt has {MAX_PROMPT + 300} tokens but MAX_PROMPT_LEN is {MAX_PROMPT}" in message
    setting = "raise max_prompt_len (MAX_PROMPT_LEN / NPUW_LLM_MAX_PROMPT_LEN)"
    assert f"{setting} to at least {MAX_PROMPT + 300}" in message
    result = any_pipe.generate(text_ids(12), max_new_tokens=2, ignore_eos=True)
    assert len(result.tokens) == 2
