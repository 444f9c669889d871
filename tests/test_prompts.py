"""Prompts: the start of the stdlib text, at any length the text has, whatever the tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.tools.prompts import prompt_ids, stdlib_text


def test_prompt_is_the_start_of_the_text(smol_tokenizer) -> None:
    ids = prompt_ids(smol_tokenizer, 64)
    text = smol_tokenizer.decode(ids.tolist())
    assert stdlib_text().startswith(text.strip()[:200])


def test_prompts_beyond_the_tokenizers_truncation(smol_tokenizer) -> None:
    # openvino-genai's GGUF tokenizer keeps only the last 8192 tokens of one long input, so
    # encoding the text whole could not give these
    long = prompt_ids(smol_tokenizer, 12000)
    assert long.size == 12000
    assert np.array_equal(long[:1000], prompt_ids(smol_tokenizer, 1000))  # prefixes agree


def test_too_long_a_prompt_names_the_length(smol_tokenizer) -> None:
    with pytest.raises(ValueError, match="fewer than the 10000000 asked"):
        prompt_ids(smol_tokenizer, 10_000_000)
