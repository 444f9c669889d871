"""Sliding-window models on every path: tiny random Mistral (every layer windowed) and Qwen2
(full and windowed layers alternating), exported by optimum-intel like any transformers model.

The window (8) is smaller than the chunk (16) and the prompts (up to 60), so a path that
attends outside it gives other tokens than openvino-genai's CPU pipeline, the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import shared_tiny_ir

from npuw_kv.cli.describe import describe
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import ModelLayoutError
from npuw_kv.model import window
from npuw_kv.model.families import declared_window
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.static import runner as static_runner

C, WINDOW = 16, 8
RING = 32  # window + one chunk of slots, in whole chunks (model/ring.py)
SETTINGS = dict(prefill_chunk_size=C, max_prompt_len=64, min_response_len=40, **EXACT_F32)
EXPECTED_WINDOWS = {"mistral": (WINDOW, WINDOW), "qwen2": (None, WINDOW)}
PATHS = {
    "cpu-sdpa": ("CPU", {"attention_backend": "sdpa"}),
    "cpu-static": ("CPU", {"attention_backend": "sdpa", "static_models": True}),
    "cpu-copy": ("CPU", {"attention_backend": "sdpa", "kv_binding": "copy"}),
    "cpu-pa": ("CPU", {"attention_backend": "pa"}),
    # windowed layers at full length (the others keep them in rings: model/ring.py)
    "cpu-sdpa-full": ("CPU", {"attention_backend": "sdpa", "window_kv": "full"}),
    "npu-full": ("NPU", {"NPUW_ONLINE_PIPELINE": "NONE", "window_kv": "full"}),
    "npu-v-transposed": ("NPU", {"NPUW_ONLINE_PIPELINE": "NONE", "optimize_v_tensors": True}),
    "npu-contiguous": ("NPU", {"NPUW_ONLINE_PIPELINE": "NONE", "kv_binding": "contiguous"}),
    # NPUW's default partitioning cannot run graphs this small (see test_tiny_model.py)
    "npu": ("NPU", {"NPUW_ONLINE_PIPELINE": "NONE"}),
}


def _ids(length: int) -> np.ndarray:
    return (np.arange(length, dtype=np.int64) * 104729 + 5) % 49000 + 100


@pytest.fixture(scope="module", params=sorted(EXPECTED_WINDOWS))
def swa(request, tmp_path_factory) -> tuple[str, Path]:
    """(arch, model dir)"""
    root = tmp_path_factory.mktemp(request.param)
    out = shared_tiny_ir(
        tmp_path_factory, root / "ir", arch=request.param, sliding_window=WINDOW, std=0.2, seed=3
    )
    return request.param, out


@pytest.fixture(scope="module")
def reference(swa):
    """Greedy tokens of openvino-genai's CPU pipeline, exact f32."""
    pipe = openvino_genai.LLMPipeline(str(swa[1]), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)

    def run(ids: np.ndarray, n: int) -> list[int]:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos = n, True
        return [int(t) for t in pipe.generate(ov.Tensor(ids[None]), config).tokens[0]]

    return run


def test_windows_are_found_per_layer(swa):
    arch, model_dir = swa
    pipe = LLMPipeline(model_dir, "CPU", attention_backend="sdpa", **SETTINGS)
    assert pipe.layout.window == EXPECTED_WINDOWS[arch]
    assert declared_window(model_dir) == WINDOW
    text = describe(str(model_dir), attention_backend="sdpa")
    per_layer = ", ".join("full" if w is None else str(w) for w in EXPECTED_WINDOWS[arch])
    assert f"(per layer: {per_layer})" in text


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.npu_path) if p.startswith("npu") else p
        for p in sorted(PATHS)
    ],
)
def test_sliding_window_greedy_matches_genai(swa, reference, path):
    device, extra = PATHS[path]
    pipe = LLMPipeline(swa[1], device, **{**SETTINGS, **extra})
    for length in (C + 1, 60):  # past the window in the prompt, and for 24 generated tokens
        ids = _ids(length)
        tokens = pipe.generate(ids, max_new_tokens=24, ignore_eos=True).tokens
        assert tokens == reference(ids, 24), f"{path}, prompt of {length}"
        assert len(set(tokens)) > 4  # a meaningful comparison, not a constant loop
    if extra.get("attention_backend") != "pa":
        rings = {} if extra.get("window_kv") == "full" else {WINDOW: RING}
        assert pipe.kv_stats()["window_rings"] == rings


def test_ring_holds_window_plus_chunk_and_full_layers_whole(swa):
    """Static path: a windowed layer's buffers are its ring (window + one chunk, in whole
    chunks), a full layer's the whole capacity; the KV bytes follow."""
    arch, model_dir = swa
    ring = LLMPipeline(model_dir, "NPU", NPUW_ONLINE_PIPELINE="NONE", **SETTINGS)
    full = LLMPipeline(model_dir, "NPU", NPUW_ONLINE_PIPELINE="NONE", window_kv="full", **SETTINGS)
    capacity = ring.kv_stats()["kv_capacity_tokens"]
    for name, blocks in ring.runner.cache.blocks.items():  # a full layer's may be cut in blocks
        layer = int(name.split(".")[1])
        want = capacity if EXPECTED_WINDOWS[arch][layer] is None else RING
        assert sum(block.shape[2] for _, block in blocks) == want, name
    per_slot = full.kv_stats()["kv_bytes_allocated"] // capacity
    windowed = sum(w is not None for w in EXPECTED_WINDOWS[arch]) / len(EXPECTED_WINDOWS[arch])
    expected = per_slot * (capacity * (1 - windowed) + RING * windowed)
    assert ring.kv_stats()["kv_bytes_allocated"] == expected
    assert ring.kv_stats()["kv_bytes_allocated"] < full.kv_stats()["kv_bytes_allocated"]
    # `npuw-kv inspect` states the same bytes, ring by ring
    text = describe(str(model_dir), "NPU", **SETTINGS)
    whole = full.kv_stats()["kv_bytes_allocated"]
    assert f"= {expected / 2**10:.1f} KiB (every layer whole: {whole / 2**10:.1f} KiB" in text
    n_windowed = sum(w is not None for w in EXPECTED_WINDOWS[arch])
    assert f"a ring of {RING} in {n_windowed} (window {WINDOW})" in text


def test_ring_masks_are_what_keeps_the_window(swa, reference, monkeypatch):
    """With every ring slot let through (the mask input all zeros), the ring's stale and
    overwritten slots are read and the tokens go wrong: the test above measures the mask."""

    def everything(start: int, n: int, first: int, window: int, ring: int) -> np.ndarray:
        return np.zeros((1, 1, n, ring + n), np.float16)

    monkeypatch.setattr(static_runner, "window_mask", everything)
    pipe = LLMPipeline(swa[1], "CPU", attention_backend="sdpa", **SETTINGS)
    ids = _ids(60)
    assert pipe.generate(ids, max_new_tokens=24, ignore_eos=True).tokens != reference(ids, 24)


def test_ring_continuation_off_the_chunk_grid_wraps_through_staging(swa, reference):
    """A chat turn resumes at a slot off the chunk grid: a chunk that would wrap around the
    ring's end is staged and copied in two pieces (counted), and the tokens stay genai's."""
    pipe = LLMPipeline(swa[1], "NPU", NPUW_ONLINE_PIPELINE="NONE", **SETTINGS)
    first = _ids(21)
    answer = pipe.generate(first, max_new_tokens=4, ignore_eos=True).tokens
    follow = np.concatenate([first, answer, _ids(40)[25:33] + 7])  # resumes at slot 28
    tokens = pipe.generate(follow, max_new_tokens=12, ignore_eos=True).tokens
    stats = pipe.kv_stats()
    assert stats["reused_tokens"] > 0
    assert stats["prefill_host_bytes_copied"] > 0  # the wrapped chunk's rows
    assert tokens == reference(follow, 12)


def test_ring_continuation_refused_once_the_window_is_overwritten(swa, reference):
    """A prompt that shares only the start of a long cached sequence cannot resume from it:
    the later tokens overwrote that part of the ring.  It runs fresh, with genai's tokens."""
    pipe = LLMPipeline(swa[1], "CPU", attention_backend="sdpa", **SETTINGS)
    first = _ids(60)
    pipe.generate(first, max_new_tokens=4, ignore_eos=True)
    branch = np.concatenate([first[:20], _ids(30)[:20] + 11])
    tokens = pipe.generate(branch, max_new_tokens=12, ignore_eos=True).tokens
    assert pipe.kv_stats()["reused_tokens"] == 0
    assert tokens == reference(branch, 12)
    full = LLMPipeline(swa[1], "CPU", attention_backend="sdpa", window_kv="full", **SETTINGS)
    full.generate(first, max_new_tokens=4, ignore_eos=True)
    full.generate(branch, max_new_tokens=12, ignore_eos=True)
    assert full.kv_stats()["reused_tokens"] > 0  # at full length the prefix is still there


def test_ring_with_a_prefix_store_is_refused_by_name(swa):
    with pytest.raises(ValueError, match="window_kv"):
        LLMPipeline(swa[1], "NPU", window_kv="ring", prefix_cache_tokens=64, **SETTINGS)


def test_paged_windowed_layers_hold_only_their_window(swa, reference):
    """On PagedAttention each window has its own block table, so a windowed layer's cache
    holds the blocks its window reads, not the whole sequence's; a prompt and answer four
    blocks long run through a two-block pool (detached table entries point at a held block,
    at times the partly written one the sequence is filling)."""
    arch, model_dir = swa
    pipe = LLMPipeline(model_dir, "CPU", attention_backend="pa", **SETTINGS)
    cache, capacity = pipe.runner.cache, pipe.kv_stats()["kv_capacity_tokens"]
    full_blocks = -(-capacity // cache.block_size)
    for layer, size in enumerate(EXPECTED_WINDOWS[arch]):
        blocks = cache.tensors[f"key_cache.{layer}"].get_shape()[0]
        assert blocks == (full_blocks if size is None else 2), (layer, blocks)
    all_full = pipe.kv_stats()["kv_bytes_per_token"] * full_blocks * cache.block_size
    assert pipe.kv_stats()["kv_bytes_allocated"] < all_full
    ids = _ids(64)
    tokens = pipe.generate(ids, max_new_tokens=40, ignore_eos=True).tokens
    assert tokens == reference(ids, 40)
    pipe.runner.blocks.check_invariants()


def test_paged_prefix_reuse_with_windows(swa):
    """A prompt that extends an earlier one (another in between) reuses its blocks in every
    window, given prefix-cache room, and gives a fresh run's logits bit for bit."""
    model_dir = swa[1]
    pipe = LLMPipeline(model_dir, "CPU", prefix_cache_tokens=64, **SETTINGS)
    fresh = LLMPipeline(model_dir, "CPU", prefix_reuse=False, **SETTINGS)
    first, other = _ids(44) + 2, _ids(40) + 1
    pipe.generate(first, max_new_tokens=4, ignore_eos=True)
    pipe.generate(other, max_new_tokens=4, ignore_eos=True)
    longer = np.concatenate([first, other[:16]])
    ours = pipe.generate(longer, max_new_tokens=8, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 32  # the whole blocks of ``first``
    want = fresh.generate(longer, max_new_tokens=8, ignore_eos=True)
    assert ours.tokens == want.tokens
    np.testing.assert_array_equal(ours.first_logits, want.first_logits)
    pipe.runner.blocks.check_invariants()


def test_paged_chat_turn_reuses_a_sequence_longer_than_the_window_pool(swa):
    """Without prefix-cache room: the first turn (80 tokens, three blocks) runs through a
    two-block window pool, taking back its own detached block; its later blocks are still
    stored, so the next turn starts from them."""
    settings = {**SETTINGS, "max_prompt_len": 128}
    pipe = LLMPipeline(swa[1], "CPU", **settings)
    fresh = LLMPipeline(swa[1], "CPU", prefix_reuse=False, **settings)
    first = _ids(70)
    answer = pipe.generate(first, max_new_tokens=10, ignore_eos=True).tokens
    follow = np.concatenate([first, answer, _ids(10) + 3])
    ours = pipe.generate(follow, max_new_tokens=8, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 64
    want = fresh.generate(follow, max_new_tokens=8, ignore_eos=True)
    assert ours.tokens == want.tokens
    np.testing.assert_array_equal(ours.first_logits, want.first_logits)


def test_without_the_rewrite_the_static_path_leaves_the_window(swa, reference, monkeypatch):
    """The models above do exercise the window: with the masks left as exported, the
    static-shape path's generate step (windowed layers at full length) attends over the
    buffer's end and goes wrong."""
    monkeypatch.setattr(window, "rewrite_window_masks", lambda model, compares: 0)
    pipe = LLMPipeline(swa[1], "CPU", attention_backend="sdpa", window_kv="full", **SETTINGS)
    ids = _ids(60)
    assert pipe.generate(ids, max_new_tokens=24, ignore_eos=True).tokens != reference(ids, 24)


def test_chat_continuation_reuses_windowed_kv(swa, reference):
    """A prompt that extends the last one reuses its slots; positions, and so the window,
    still come out right."""
    pipe = LLMPipeline(swa[1], "CPU", attention_backend="sdpa", **SETTINGS)
    first = _ids(30)
    answer = pipe.generate(first, max_new_tokens=6, ignore_eos=True).tokens
    follow = np.concatenate([first, answer, _ids(40)[30:]])
    tokens = pipe.generate(follow, max_new_tokens=12, ignore_eos=True).tokens
    assert pipe.kv_stats()["reused_tokens"] > 0
    assert tokens == reference(follow, 12)


def test_a_declared_window_whose_mask_is_not_found_is_refused(swa, monkeypatch):
    monkeypatch.setattr(window, "_as_window_compare", lambda node: None)
    with pytest.raises(ModelLayoutError, match="attention_backend='pa'"):
        LLMPipeline(swa[1], "CPU", attention_backend="sdpa", **SETTINGS)
    # PagedAttention takes the window from OpenVINO's own rewrite: inspect does not refuse
    assert "attention_backend pa" in describe(str(swa[1]), attention_backend="pa")


QWEN = {
    "model_type": "qwen2",
    "sliding_window": 512,
    "use_sliding_window": True,
    "num_hidden_layers": 28,
}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"sliding_window": 4096}, 4096),  # Mistral: a number means it applies
        ({"sliding_window": 4096, "use_sliding_window": False}, None),  # Qwen2's default
        ({"sliding_window": 512, "layer_types": ["full_attention"] * 2}, None),
        ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}, 512),
        ({"sliding_window": None}, None),
        ({}, None),
        ({"model_type": "qwen3", "sliding_window": 4096}, None),  # off unless set
        (QWEN | {"max_window_layers": 28}, None),  # windows from layer 28 of 28: none
        (QWEN | {"max_window_layers": 14}, 512),
        ({"text_config": {"sliding_window": 512}}, 512),  # multimodal configs nest it
    ],
)
def test_declared_window_reads_config_json(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert declared_window(tmp_path) == expected


def test_a_window_as_long_as_the_kv_cache_is_not_declared(tmp_path):
    """It cannot change anything (e.g. Phi-3.5's 262144), so no mask check is needed."""
    (tmp_path / "config.json").write_text(json.dumps({"sliding_window": 4096}))
    assert declared_window(tmp_path, capacity=1152) is None
    assert declared_window(tmp_path, capacity=8192) == 4096


def test_declared_window_reads_a_gguf_conversions_source_info(tmp_path):
    (tmp_path / "npuw_kv_source.json").write_text(json.dumps({"sliding_window": 1024}))
    assert declared_window(tmp_path) == 1024


@pytest.mark.npu_path
@pytest.mark.parametrize("path", ["npu", "npu-full"])
def test_packed_sequences_keep_each_window(swa, reference, path):
    """Sequences stepping together in packed generate models (model/packed.py), each past its
    window: each reads its own window (its ring, or the slots of its whole past), as alone."""
    import threading

    device, extra = PATHS[path]
    pipe = LLMPipeline(swa[1], device, max_num_seqs=4, **{**SETTINGS, **extra})
    prompts = [_ids(n) for n in (C + 1, 60, 9, 33)]
    out: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def call(i: int) -> None:
        start.wait()
        out[i] = pipe.generate(prompts[i], max_new_tokens=24, ignore_eos=True).tokens

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, tokens in zip(prompts, out, strict=True):
        assert tokens == reference(prompt, 24), f"{path}, prompt of {prompt.size}"
    stats = pipe.kv_stats()
    assert stats["packed_rows"] >= 2 * stats["packed_steps"] > 0
