"""The PagedAttention backend on CPU (``attention_backend="pa"``): one compiled model, the
plugin's paged-attention kernel over a cache we allocate; its exact-f32 tokens are checked
against openvino-genai with the other backends in test_smollm2_accuracy.py."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest
from conftest import CHUNK, MAX_PROMPT, MIN_RESPONSE

from npuw_kv import LLMPipeline
from npuw_kv.config.decide import cpu_precision
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import CapacityError, CompileError
from npuw_kv.pipeline import GenerationResult

# most of these run at the device's defaults (u8 KV, the CPU's compute precision)
pytestmark = pytest.mark.device_defaults

SHAPES = dict(prefill_chunk_size=CHUNK, max_prompt_len=MAX_PROMPT, min_response_len=MIN_RESPONSE)


@pytest.fixture(scope="module")
def pa_pipe(smol_dir) -> LLMPipeline:
    """At the device's defaults: u8 KV blocks, as openvino-genai's CPU pipeline runs."""
    return LLMPipeline(smol_dir, "CPU", **SHAPES)


@pytest.fixture(scope="module")
def fresh_pipes(smol_dir) -> tuple[LLMPipeline, LLMPipeline]:
    """No reuse, at the device's defaults (u8 KV) and with the KV stored in f32."""
    u8 = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, **SHAPES)
    f32 = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, kv_precision="f32", **SHAPES)
    return u8, f32


def _calls(pipe: LLMPipeline, ids: np.ndarray) -> tuple[list[tuple[int, int]], GenerationResult]:
    """Generate 6 tokens after ``ids``; return the (first, end) token span of every prefill
    call the device ran, and the result."""
    runner = pipe.runner
    spans: list[tuple[int, int]] = []
    run = runner.run

    def record(parts: list, rows: int = 1) -> np.ndarray:
        ((_, chunk, past),) = parts  # one sequence: one subsequence a call
        if chunk.size > 1 or not spans or spans[-1][1] != past:  # not a generate step
            spans.append((past, past + chunk.size))
        return run(parts, rows)

    runner.run = record  # type: ignore[method-assign]
    try:
        result = pipe.generate(ids, max_new_tokens=6, ignore_eos=True)
    finally:
        del runner.run
    return [s for s in spans if s[1] <= ids.size], result


def assert_same_as_fresh(pipe: LLMPipeline, fresh_pipes, ids: np.ndarray) -> GenerationResult:
    """A reused prefix gives what a fresh run gives.

    Exact by construction: the blocks kept are whole, and every call after the hit ends where a
    fresh run's does, so each u8 block is quantised from the same tokens written together (its
    scales depend on that).  The logits themselves are bit-identical only where the CPU's
    kernels give a row the same sums whatever the number of rows in the call (AMX/bf16 here);
    with f32 kernels (CPUs without BF16) the sums differ by ~1e-5, and a value that sits on a
    u8 rounding edge then lands one step away.  Such a flip moves one value by at most one
    quantisation step, while storing in u8 moves every value by up to half a step; so the
    logits are held to twice the fresh run's own u8 storage error (its distance from f32 KV).
    """
    u8, f32 = fresh_pipes
    spans, reused = _calls(pipe, ids)
    hit = pipe.kv_stats()["reused_tokens"]
    fresh_spans, alone = _calls(u8, ids)
    assert spans[0][0] == hit and {end for _, end in spans} <= {end for _, end in fresh_spans}
    assert reused.tokens == alone.tokens
    exact = f32.generate(ids, max_new_tokens=1, ignore_eos=True).first_logits
    storage_error = float(np.abs(alone.first_logits - exact).max())
    moved = float(np.abs(reused.first_logits - alone.first_logits).max())
    print(f"reused vs fresh max |dlogit| {moved:.3g}, u8 storage error {storage_error:.3g}")
    assert moved <= 2 * storage_error
    return alone


def test_one_cache_bound_once_and_nothing_copied(pa_pipe, text_ids):
    result = pa_pipe.generate(text_ids(300), max_new_tokens=8, ignore_eos=True)
    runner, stats = pa_pipe.runner, pa_pipe.kv_stats()
    for name, tensor in runner.cache.tensors.items():  # the request reads our tensors in place
        bound = runner.request.get_tensor(name)
        assert np.shares_memory(bound.data, tensor.data) and bound.shape == tensor.shape
    assert stats["kv_binding"] == "paged" and stats["shared_weights"]
    assert stats["host_bytes_copied"] == 0 and stats["switch_host_bytes_copied"] == 0
    assert stats["tokens_in_cache"] == 300 + len(result.tokens) - 1  # the last token is not fed
    # u8 blocks with their scales: fewer bytes per token than bf16 K and V (2 bytes x 2 x 3 x 64
    # x 30 layers = 23040)
    assert stats["kv_precision"] == "u8" and stats["kv_bytes_per_token"] < 23040


def test_prefix_reuse_gives_what_a_fresh_run_gives(pa_pipe, fresh_pipes, text_ids):
    """Reuse keeps whole blocks: a u8 block's scales depend on which tokens were written
    together, so the partial block is rerun from its start, and blocks that generated tokens
    completed (written one token at a time) are not cached at all.  A chat turn then reuses
    the prompt's blocks only and gives what a fresh run gives."""
    ids = text_ids(500)
    first = pa_pipe.generate(ids, max_new_tokens=20, ignore_eos=True)  # completes [480, 512)
    follow_up = np.concatenate([ids, first.tokens[:16], text_ids(40)[:20]])
    assert_same_as_fresh(pa_pipe, fresh_pipes, follow_up)
    block = pa_pipe.runner.cache.block_size
    kept = pa_pipe.kv_stats()["reused_tokens"]
    assert kept == len(ids) // block * block  # not the block the answer completed


def test_any_earlier_prompt_is_reused_not_only_the_last(pa_pipe, fresh_pipes, smol_dir, text_ids):
    """The block manager keeps every finished sequence's full blocks: after B, a prompt that
    continues A still starts from A's blocks, and gives what a fresh run gives."""
    a, b = text_ids(300), text_ids(700)[400:]
    pa_pipe.generate(a, max_new_tokens=4, ignore_eos=True)
    pa_pipe.generate(b, max_new_tokens=4, ignore_eos=True)
    follow_up = np.concatenate([a, b[:40]])
    fresh = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, **SHAPES)
    assert_same_as_fresh(pa_pipe, (fresh, fresh_pipes[1]), follow_up)
    block = pa_pipe.runner.cache.block_size
    assert pa_pipe.kv_stats()["reused_tokens"] == len(a) // block * block
    # at least b's full blocks and the follow-up's (which start with a's) stay cached
    kept_blocks = (len(b) + 3) // block + (len(follow_up) + 5) // block
    assert pa_pipe.kv_stats()["cached_tokens"] >= kept_blocks * block
    assert fresh.kv_stats()["reused_tokens"] == 0 and fresh.runner.blocks.stats().hit_tokens == 0
    # without reuse the prompt's full blocks are still stored, to serve once it is on (u8 KV:
    # not those the generated tokens completed, see the next test)
    assert fresh.kv_stats()["cached_tokens"] == len(follow_up) // block * block
    pa_pipe.runner.blocks.check_invariants()


def test_a_chunk_size_off_the_block_grid_still_reuses_exactly(smol_dir, text_ids):
    """With C = 48 a fresh run writes block [32, 64) in two calls; after a hit the chunks end
    where a fresh run's do (multiples of C), so every u8 block gets the same scales."""
    shapes = dict(prefill_chunk_size=48, max_prompt_len=336, min_response_len=8)
    pipe = LLMPipeline(smol_dir, "CPU", **shapes)
    fresh = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, **shapes)
    f32 = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, kv_precision="f32", **shapes)
    ids = text_ids(300)
    pipe.generate(ids[:130], max_new_tokens=2, ignore_eos=True)
    assert_same_as_fresh(pipe, (fresh, f32), ids)
    assert pipe.kv_stats()["reused_tokens"] == 128


def test_a_small_cache_evicts_old_prefixes_and_stays_right(smol_dir, text_ids):
    """Seven blocks of 32 for 90-token prompts in turn: least recently used blocks make room,
    every answer equals a fresh run's, and the manager's invariants hold throughout."""
    shapes = dict(max_prompt_len=192, min_response_len=8, prefill_chunk_size=32)
    pipe = LLMPipeline(smol_dir, "CPU", **shapes, **EXACT_F32)
    fresh = LLMPipeline(smol_dir, "CPU", prefix_reuse=False, **shapes, **EXACT_F32)
    text = text_ids(400)
    prompts = [text[:90], text[100:190], text[200:290], text[:95], text[100:150]]
    reused = []
    for ids in prompts:
        got = pipe.generate(ids, max_new_tokens=4, ignore_eos=True)
        want = fresh.generate(ids, max_new_tokens=4, ignore_eos=True)
        assert got.tokens == want.tokens
        assert np.abs(got.first_logits - want.first_logits).max() < 1e-4
        pipe.runner.blocks.check_invariants()
        reused.append(pipe.kv_stats()["reused_tokens"])
    window = next(iter(pipe.runner.blocks.stats().windows.values()))
    assert window.primary_total == pipe.runner.cache.num_blocks == 7
    # three prompts leave six full blocks cached.  The fourth starts from the first one's two;
    # its second new block evicts from the least recently used chain, the second prompt's, and
    # from its end (evicting its first block would cut the other one from the tree too).  So
    # the fifth, which starts like the second, still reuses that chain's first block
    assert reused == [0, 0, 0, 64, 32] and window.counters.removed_blocks == 1


def test_prefix_cache_tokens_keep_earlier_prompts_beside_a_full_sequence(smol_dir, text_ids):
    """PREFIX_CACHE_TOKENS adds blocks beyond one sequence's: the same five prompts as above
    evict nothing, and a sequence may still hold only MAX_PROMPT_LEN + MIN_RESPONSE_LEN."""
    shapes = dict(max_prompt_len=192, min_response_len=8, prefill_chunk_size=32)
    pipe = LLMPipeline(smol_dir, "CPU", PREFIX_CACHE_TOKENS=96, **shapes, **EXACT_F32)
    assert pipe.runner.cache.num_blocks == 10 and pipe.runner.remaining_capacity == 200
    text = text_ids(400)
    for ids in (text[:90], text[100:190], text[200:290], text[:95], text[100:150]):
        pipe.generate(ids, max_new_tokens=4, ignore_eos=True)
        pipe.runner.blocks.check_invariants()
    window = next(iter(pipe.runner.blocks.stats().windows.values()))
    assert window.counters.removed_blocks == 0 and pipe.kv_stats()["kv_capacity_tokens"] == 296
    result = pipe.generate(text[:180], max_new_tokens=30, ignore_eos=True)
    assert result.finish_reason == "length" and pipe.kv_stats()["tokens_in_cache"] == 200


def test_auto_falls_back_to_the_static_path_when_paged_attention_does_not_compile(
    smol_dir, text_ids, monkeypatch
):
    """A CPU the plugin has no paged kernel for: ``auto`` warns and runs the static-shape path,
    where the prefix-cache room becomes its host store."""
    import npuw_kv.runtime.build as build_module

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Exception from the plugin: no PagedAttention kernel here")

    monkeypatch.setattr(build_module, "compile_paged", refuse)
    with pytest.warns(RuntimeWarning, match="PagedAttention did not compile.*prefix_cache_tokens"):
        pipe = LLMPipeline(smol_dir, "CPU", prefix_cache_tokens=64, **SHAPES)
    assert not pipe.config.paged and pipe.config.prefix_cache_tokens == 64
    assert pipe.runner.prefix_store is not None and pipe.runner.prefix_store.capacity == 64
    assert pipe.kv_stats()["kv_binding"] == "roi"
    assert len(pipe.generate(text_ids(40), max_new_tokens=3, ignore_eos=True).tokens) == 3
    with pytest.raises(CompileError, match="no PagedAttention kernel"):  # asked for by name
        LLMPipeline(smol_dir, "CPU", attention_backend="pa", **SHAPES)


def test_a_failure_mid_prompt_forgets_the_cache_and_the_next_prompt_runs_cold(smol_dir, text_ids):
    pipe = LLMPipeline(smol_dir, "CPU", prefill_chunk_size=64, **EXACT_F32)
    ids = text_ids(200)
    pipe.generate(ids, max_new_tokens=2, ignore_eos=True)

    def stop(positions: np.ndarray, logits: np.ndarray) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe.runner.prefill(text_ids(300), on_chunk=stop)  # after its first chunk ran
    assert pipe.runner.tokens_in_cache == 0 and pipe.runner.cached_tokens == 0
    again = pipe.generate(ids, max_new_tokens=2, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 0 and len(again.tokens) == 2


def test_a_full_cache_ends_with_length_and_long_prompts_are_refused(smol_dir, text_ids):
    pipe = LLMPipeline(
        smol_dir,
        "CPU",
        attention_backend="pa",
        max_prompt_len=64,
        min_response_len=8,
        prefill_chunk_size=32,
    )
    result = pipe.generate(text_ids(60), max_new_tokens=50, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.tokens) == 64 + 8 - 60 + 1
    with pytest.raises(CapacityError, match="MAX_PROMPT_LEN is 64.*at least 65"):
        pipe.generate(text_ids(65), max_new_tokens=2)
    assert len(pipe.generate(text_ids(10), max_new_tokens=3, ignore_eos=True).tokens) == 3


def test_full_prefill_logits_give_every_row(smol_dir, text_ids):
    """Prompt perplexity (``npuw-kv accuracy``) needs the LM head on every prompt token."""
    pipe = LLMPipeline(
        smol_dir, "CPU", attention_backend="pa", full_prefill_logits=True, prefill_chunk_size=64
    )
    rows: list[np.ndarray] = []
    last = pipe.runner.prefill(text_ids(150), on_chunk=lambda pos, lg: rows.append(pos))
    assert np.array_equal(np.concatenate(rows), np.arange(150)) and last.shape == (49152,)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"device": "NPU", "attention_backend": "pa"}, "CPU only.*device NPU"),
        ({"attention_backend": "pa", "static_models": True}, "static_models=True"),
        ({"attention_backend": "pa", "kv_binding": "copy"}, "kv_binding='copy'"),
        ({"attention_backend": "sdpa", "kv_precision": "u8"}, "'u8' needs attention_backend"),
        ({"attention_backend": "flash"}, r"attention_backend \(ATTENTION_BACKEND\) 'flash'"),
        ({"attention_backend": "sdpa", "prefix_cache_tokens": 16}, "PREFIX_CACHE_TOKENS.*32"),
        ({"device": "NPU", "PREFIX_CACHE_TOKENS": 31}, "PREFIX_CACHE_TOKENS.*at least 32"),
        ({"prefix_cache_tokens": -1}, r"prefix_cache_tokens \(PREFIX_CACHE_TOKENS\) must be >= 0"),
    ],
)
def test_settings_the_backend_cannot_honour_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig.from_kwargs(**settings)
    assert PipelineConfig.from_kwargs(ATTENTION_BACKEND="PA").paged


def test_a_kv_precision_the_paged_kernel_cannot_store_is_refused_by_name(smol_dir):
    """Under f32 compute the paged kernel stores u8, f16 or f32 KV, not bf16."""
    with pytest.raises(CompileError, match=r"KV_CACHE_PRECISION.*attention_backend='sdpa'"):
        LLMPipeline(smol_dir, "CPU", attention_backend="pa", kv_precision="bf16", **EXACT_F32)
    # under bf16 compute f16 is refused too, and f32 compute named as what stores it
    settings = dict(attention_backend="pa", kv_precision="f16", INFERENCE_PRECISION_HINT="bf16")
    if cpu_precision(ov.Core(), PipelineConfig.from_kwargs("CPU", **settings)) == "bf16":
        with pytest.raises(CompileError, match=r"set INFERENCE_PRECISION_HINT=f32 to store it"):
            LLMPipeline(smol_dir, "CPU", **settings)
    else:  # a CPU without bf16 computes in f32, where the kernel stores f16
        assert LLMPipeline(smol_dir, "CPU", **settings).engine.decided.kv_precision == "f16"
