"""Tiny random Llamas of our making, from both model sources: fast, different shapes.

4 query / 2 KV heads, head_dim 16, 2 layers: exercises GQA, the broadcast fix and the chunk
loop with a small chunk (C=16) on graphs that are not SmolLM2's.  Each test runs on a GGUF
converted by openvino-genai (models/make_tiny_gguf.py) and on an optimum-intel IR directory
(models/make_tiny_optimum_ir.py: transformers + optimum-intel, whose graph differs in input and
state names, RoPE, GQA and SDPA form, and rt_info).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.pipeline import LLMPipeline

C = 16


# NPUW's default partitioning cannot create an infer request for this tiny graph even
# without our rewrites ("Failed to set tensor ... precision f32 ... model input ... f16" inside
# its CPU sub-requests), so the NPU path runs it unpartitioned; SmolLM2 covers partitioning.
DEVICE_EXTRA = {"CPU": {}, "NPU": {"NPUW_ONLINE_PIPELINE": "NONE"}}


@pytest.fixture(scope="module", params=["CPU", pytest.param("NPU", marks=pytest.mark.npu_path)])
def tiny_pipe(request, tiny_dir):
    return LLMPipeline(
        tiny_dir,
        request.param,
        prefill_chunk_size=C,
        max_prompt_len=64,
        min_response_len=40,
        **EXACT_F32,
        **DEVICE_EXTRA[request.param],
    )


@pytest.mark.parametrize("length", [1, C - 1, C, C + 1, 60])
def test_tiny_greedy_matches_genai(tiny_pipe, tiny_reference, length):
    ids = (np.arange(length, dtype=np.int64) * 7919 + 11) % 49000 + 100
    result = tiny_pipe.generate(ids, max_new_tokens=32, ignore_eos=True)
    assert result.tokens == tiny_reference(ids, 32)
    assert len(set(result.tokens)) > 4  # a meaningful comparison, not a constant loop


def test_tiny_layout(tiny_dir):
    kwargs = dict(prefill_chunk_size=C, max_prompt_len=64, min_response_len=40, **EXACT_F32)
    sdpa = LLMPipeline(tiny_dir, "CPU", attention_backend="sdpa", **kwargs)
    layout = sdpa.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    paged = LLMPipeline(tiny_dir, "CPU", attention_backend="pa", **kwargs)  # f32 KV blocks
    for pipe in (sdpa, paged):
        assert pipe.kv_stats()["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


@pytest.mark.parametrize(
    "extra",
    [
        {"static_models": True},
        {"kv_binding": "copy"},
        {"static_models": True, "kv_binding": "copy"},
        {"static_models": True, "prefill_chunk_size": 64},  # one chunk: no prefill past at all
        {"prefill_chunk_size": 64},  # one chunk, on the default (PagedAttention) backend
        {"attention_backend": "sdpa"},  # CPU's static-shape path (the default is PagedAttention)
    ],
)
def test_tiny_cpu_variants_match(tiny_dir, tiny_reference, extra):
    settings = {"prefill_chunk_size": C, "max_prompt_len": 64, "min_response_len": 40}
    pipe = LLMPipeline(tiny_dir, "CPU", **{**settings, **EXACT_F32, **extra})
    for length in (C + 1, 60):
        ids = (np.arange(length, dtype=np.int64) * 104729 + 5) % 49000 + 100
        assert pipe.generate(ids, max_new_tokens=24, ignore_eos=True).tokens == tiny_reference(
            ids, 24
        )
    copied = pipe.kv_stats()["host_bytes_copied"]
    assert (copied > 0) == (extra.get("kv_binding") == "copy")


@pytest.mark.device_defaults  # whether the plugin keeps the half-precision round trip
@pytest.mark.parametrize(("precision", "bound"), [("f16", 0.05), ("bf16", 0.3)])
def test_tiny_half_precision_kv_stays_close(tiny_dir, precision, bound):
    kwargs = dict(prefill_chunk_size=C, max_prompt_len=64, min_response_len=40, **EXACT_F32)
    f32 = LLMPipeline(tiny_dir, "CPU", attention_backend="sdpa", **kwargs)
    f16 = LLMPipeline(tiny_dir, "CPU", kv_precision=precision, **kwargs)  # sdpa: precision named
    ids = (np.arange(50, dtype=np.int64) * 31 + 7) % 49000 + 100
    a = f32.generate(ids, max_new_tokens=8, ignore_eos=True)
    b = f16.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert f16.kv_stats()["kv_bytes_allocated"] * 2 == f32.kv_stats()["kv_bytes_allocated"]
    delta = float(np.abs(a.first_logits - b.first_logits).max())
    print(f"{precision} KV: max |dlogit| {delta:.2e}")
    assert 0 < delta < bound  # storage rounds (f32 compute here), but only slightly


def _plugin_keeps_rounding(dtype: str) -> bool:
    """Whether the CPU plugin computes ``convert(convert(x, dtype), f32)`` as written under the
    f32 hint.  It drops the pair where the CPU lacks arithmetic in ``dtype`` (f16 on most x86
    CPUs, bf16 on those without AVX512-BF16/AMX)."""
    from openvino import opset13 as ops

    x = ops.parameter([1, 4], np.float32)
    twice = ops.convert(ops.convert(x, getattr(ov.Type, dtype)), ov.Type.f32)
    model = ov.Model([ops.multiply(twice, ops.constant(np.float32(1)))], [x])
    value = np.full((1, 4), 1 + 2.0**-12, np.float32)  # not representable in bf16 or f16
    out = ov.Core().compile_model(model, "CPU", EXACT_F32)(value)[0]
    return not np.array_equal(out, value)


@pytest.mark.device_defaults
def test_tiny_bf16_kv_depends_on_the_chunk_no_more_than_f32(tiny_dir):
    """A token attends to the KV as the cache stores it, its own chunk's included (rounded to
    bf16 before attention), so changing the prefill chunk moves bf16-KV logits no more than it
    moves f32-KV logits (where only the kernels' summation order changes, ~1e-6).

    Where the CPU has no bf16 arithmetic the plugin drops that round trip: a token then sees
    its own chunk unrounded and the chunk size matters.  There the test checks that this is the
    whole cause: a prompt run as one chunk never reads stored KV, and its bf16-KV logits are
    the f32-KV ones."""
    ids = (np.arange(50, dtype=np.int64) * 31 + 7) % 49000 + 100
    kwargs = dict(max_prompt_len=64, min_response_len=40, **EXACT_F32)
    moved, first = {}, {}
    for precision in ("f32", "bf16"):
        first[precision] = []
        for chunk in (8, 32):
            pipe = LLMPipeline(
                tiny_dir, "CPU", kv_precision=precision, prefill_chunk_size=chunk, **kwargs
            )
            first[precision].append(pipe.generate(ids, max_new_tokens=1).first_logits)
        moved[precision] = float(np.abs(first[precision][0] - first[precision][1]).max())
    print(f"logits moved by the chunk size: {moved}")
    if _plugin_keeps_rounding("bf16"):
        assert moved["bf16"] <= max(moved["f32"], 1e-5)
        return
    one_chunk = [
        LLMPipeline(tiny_dir, "CPU", kv_precision=p, prefill_chunk_size=64, **kwargs)
        .generate(ids, max_new_tokens=1)
        .first_logits
        for p in ("f32", "bf16")
    ]
    assert moved["bf16"] > 1e-4  # the chunk matters here ...
    assert np.abs(one_chunk[0] - one_chunk[1]).max() <= 1e-5  # ... only through stored KV


def test_a_kv_precision_given_wins_over_the_irs_runtime_options(tiny_dir):
    """optimum-intel writes KV_CACHE_PRECISION=f16 into its IRs' runtime options; a
    kv_precision the user gives (u8, the plugin's own default included) is what the paged
    cache holds."""
    pipe = LLMPipeline(tiny_dir, "CPU", attention_backend="pa", kv_precision="u8")
    compiled = pipe.runner.request.get_compiled_model()
    assert str(compiled.get_property("KV_CACHE_PRECISION")) == "<Type: 'uint8_t'>"
    assert {t.element_type for t in pipe.runner.cache.tensors.values()} == {ov.Type.u8}


def test_auto_paged_kv_is_what_genais_pipeline_compiles(tiny_dir):
    """``auto`` leaves the paged KV precision to the plugin, which reads an optimum-intel IR's
    runtime option (f16) and otherwise takes its default (u8), as for genai's pipeline on the
    same IR: the two compiled models report the same KV_CACHE_PRECISION (genai's read from
    its OPENVINO_LOG_LEVEL=4 print of the compiled LLM's properties)."""
    import os
    import re
    import subprocess
    import sys

    script = (
        "import openvino_genai as g, sys; p = g.LLMPipeline(sys.argv[1], 'CPU'); "
        "p.generate('hi', max_new_tokens=1)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tiny_dir)],
        env={**os.environ, "OPENVINO_LOG_LEVEL": "4"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    llm = out[out.index("Model: LLM with Paged Attention") :]
    theirs = re.search(r"KV_CACHE_PRECISION: (\w+)", llm)
    assert theirs is not None, llm[:400]
    auto = LLMPipeline(tiny_dir, "CPU", attention_backend="pa")
    ours = auto.runner.request.get_compiled_model().get_property("KV_CACHE_PRECISION")
    assert ours.get_type_name() == theirs.group(1)
