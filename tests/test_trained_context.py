"""The model's trained context: read from the GGUF or config.json, and never run past."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.model.families import trained_context
from npuw_kv.model.source import SOURCE_INFO, resolve_model
from npuw_kv.pipeline import LLMPipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402
from make_tiny_optimum_ir import make_tiny_optimum_ir  # noqa: E402

CONTEXT = 80  # positions the tiny models claim to be trained for
SHAPES = {"prefill_chunk_size": 16, "max_prompt_len": 64, "min_response_len": 40, **EXACT_F32}


@pytest.fixture(scope="module", params=["gguf", "optimum-intel"])
def short_model(request, tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("short")
    if request.param == "optimum-intel":
        ir = resolve_model(make_tiny_optimum_ir(root / "ir", context=CONTEXT, seed=5))
        return ir, "config.json max_position_embeddings"
    gguf = make_tiny_gguf(root / "tiny.gguf", context=CONTEXT, seed=5, dtype="Q8_0")
    ir = resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)
    return ir, "GGUF llama.context_length"


def test_trained_context_is_read_from_the_source(short_model):
    ir, where = short_model
    assert trained_context(ir) == (CONTEXT, where)


def test_a_gguf_cache_without_the_record_gets_it_back(tmp_path):
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", context=CONTEXT, seed=5, dtype="Q8_0")
    ir = resolve_model(gguf, cache_dir=tmp_path / "cache", log=lambda *a, **k: None)
    (ir / SOURCE_INFO).unlink()  # as a cache converted by an older npuw-kv
    assert trained_context(ir) is None
    assert resolve_model(gguf, cache_dir=tmp_path / "cache", log=lambda *a, **k: None) == ir
    assert trained_context(ir) == (CONTEXT, "GGUF llama.context_length")


def test_max_prompt_len_beyond_the_trained_context_is_refused(short_model):
    ir, where = short_model
    with pytest.raises(ValueError, match=r"MAX_PROMPT_LEN 96 .* trained context of 80") as info:
        LLMPipeline(ir, "CPU", **{**SHAPES, "max_prompt_len": 96})
    assert where in str(info.value) and "max_prompt_len" in str(info.value)


def test_generation_stops_at_the_trained_context(short_model):
    ir, _ = short_model
    with pytest.warns(RuntimeWarning, match="trained context of 80"):
        pipe = LLMPipeline(ir, "CPU", **SHAPES)  # asks KV for 104 tokens, trained for 80
    # slots no position inside the context can reach are not allocated
    assert pipe.runner.remaining_capacity == CONTEXT + SHAPES["prefill_chunk_size"] - 1
    ids = (np.arange(60, dtype=np.int64) * 7919 + 11) % 49000 + 100
    result = pipe.generate(ids, max_new_tokens=40, ignore_eos=True)
    assert result.finish_reason == "length"
    assert len(result.tokens) == CONTEXT - ids.size  # prompt + output fill the context exactly
    shorter = pipe.generate(ids[:30], max_new_tokens=40, ignore_eos=True)
    assert len(shorter.tokens) == 40  # well inside the context: max_new_tokens decides


def test_inspect_applies_the_same_rules(short_model):
    """``npuw-kv inspect`` shows the shapes a pipeline would use, or refuses as it would."""
    from npuw_kv.cli.describe import describe

    ir, _ = short_model
    with pytest.raises(ValueError, match="trained context of 80"):
        describe(str(ir), **{**SHAPES, "max_prompt_len": 96})
    with pytest.warns(RuntimeWarning, match="trained context of 80"):
        text = describe(str(ir), **SHAPES)
    assert "KV cache         95 tokens" in text  # capped at the context plus the chunk's padding
    with pytest.warns(RuntimeWarning, match="trained context of 80"):
        text = describe(str(ir), **SHAPES, attention_backend="sdpa")
    assert "attention_mask [1,95]" in text
