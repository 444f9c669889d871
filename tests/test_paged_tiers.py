"""The block manager's tiers through the pipeline (PagedAttention, the CPU default): memory
shares between window pools, the host tier of the prefix cache, a chat's system prompt held
at high priority; each seen in ``kv_stats()``.

The tiny random Qwen2 (a full-attention layer and a window-8 layer) gives two window pools;
the prompts (up to 120 tokens) span several 32-token blocks, so pools of a few blocks evict.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_pipe, shared_tiny_ir

from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.kv.blocks import SHARES_ENV
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.paged.runner import SYSTEM_PRIORITY

C, WINDOW, BLOCK = 16, 8, 32
SETTINGS = dict(prefill_chunk_size=C, max_prompt_len=128, min_response_len=40, **EXACT_F32)
SYSTEM = "You are a careful assistant. " * 13  # two whole blocks of the chat prompt
SHARES_NAME = "kv_window_shares"


def _ids(length: int, salt: int = 0) -> np.ndarray:
    return (np.arange(length, dtype=np.int64) * 104729 + 5 + 7919 * salt) % 49000 + 100


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen2")
    return shared_tiny_ir(
        tmp_path_factory, root / "ir", arch="qwen2", sliding_window=WINDOW, std=0.2, seed=3
    )


@pytest.fixture(scope="module")
def fresh(qwen2):
    """``run(ids, n)``: a pipeline that never reuses: the tokens and first logits to match."""
    pipe = LLMPipeline(qwen2, "CPU", prefix_reuse=False, **SETTINGS)
    return lambda ids, n: pipe.generate(ids, max_new_tokens=n, ignore_eos=True)


def _run(pipe: LLMPipeline, ids: np.ndarray, n: int = 8):
    return pipe.generate(ids, max_new_tokens=n, ignore_eos=True)


# -- host tier ------------------------------------------------------------------------------
def test_host_tier_takes_evicted_blocks_and_restores_them_on_a_hit(qwen2, fresh):
    """A, then B (which needs A's blocks), then A again: with a host tier, A's blocks went
    to host memory and come back, the same tokens and logits as a fresh run; without one, A
    is gone."""
    a, b = _ids(100), _ids(120, 1)
    pipe = LLMPipeline(qwen2, "CPU", prefix_cache_host_tokens=256, **SETTINGS)
    stats = pipe.kv_stats()
    assert stats["host_tier_blocks"] == {"8": 8, "full": 8}
    # 8 blocks of each layer: 8 blocks of every token row
    assert stats["host_tier_bytes_allocated"] == 8 * BLOCK * stats["kv_bytes_per_token"]
    assert stats["host_tier_bytes_held"] == stats["host_tier_bytes_offloaded"] == 0
    _run(pipe, a)
    _run(pipe, b)
    stats = pipe.kv_stats()
    offloaded = stats["host_tier_bytes_offloaded"]
    assert offloaded > 0 and stats["host_tier_offloads"] > 0
    assert 0 < stats["host_tier_bytes_held"] <= offloaded
    assert stats["host_tier_bytes_restored"] == 0
    ours = _run(pipe, a)
    stats = pipe.kv_stats()
    assert stats["reused_tokens"] == 96  # every whole block of A, one token left to run
    assert stats["host_tier_bytes_restored"] > 0 and stats["host_tier_restores"] > 0
    moved = stats["host_tier_bytes_offloaded"] + stats["host_tier_bytes_restored"]
    assert stats["host_bytes_copied"] >= moved
    want = fresh(a, 8)
    assert ours.tokens == want.tokens
    np.testing.assert_array_equal(ours.first_logits, want.first_logits)
    pipe.runner.blocks.check_invariants()

    plain = LLMPipeline(qwen2, "CPU", **SETTINGS)  # no host tier: A is evicted for good
    assert plain.kv_stats()["host_tier_bytes_allocated"] == 0
    for ids in (a, b, a):
        _run(plain, ids)
    assert plain.kv_stats()["reused_tokens"] == 0
    assert plain.kv_stats()["host_tier_bytes_offloaded"] == 0


def test_smollm2_prefix_restored_from_the_host_tier(smol_dir):
    """The real model: a 512-token prompt evicted to the host tier by a 1000-token one and
    asked again runs only its last block, and answers as it did cold."""
    pipe = make_pipe(
        smol_dir, "CPU", attention_backend="pa", kv_precision="f32", prefix_cache_host_tokens=1024
    )
    a, b = _ids(512, 2) % 40000 + 200, _ids(1000, 3) % 40000 + 200
    cold = _run(pipe, a, 16)
    _run(pipe, b, 16)
    assert pipe.kv_stats()["host_tier_bytes_offloaded"] > 0
    warm = _run(pipe, a, 16)
    stats = pipe.kv_stats()
    assert stats["reused_tokens"] == 512 - BLOCK
    assert stats["host_tier_bytes_restored"] > 0
    assert warm.tokens == cold.tokens
    # the warm run's one chunk is 16 rows, the cold run's 256: on an AVX2-only CPU the kernel
    # sums them in another order (3.5e-5 measured); a wrong restored block moves logits by O(1)
    assert np.abs(warm.first_logits - cold.first_logits).max() < 1e-4


# -- window shares ----------------------------------------------------------------------------
def test_window_shares_split_the_prefix_cache_room(qwen2, fresh):
    """Shares move the room's bytes between the pools (8: 2 blocks + 3/4 of 8 layer-blocks,
    full: 6 + 1/4) instead of the same tokens in each; the answers stay a fresh run's."""
    room = dict(prefix_cache_tokens=128, **SETTINGS)
    default = LLMPipeline(qwen2, "CPU", **room).kv_stats()
    assert default["kv_pool_blocks"] == {"8": 6, "full": 10}
    assert default["kv_window_shares_given"] is False
    pipe = LLMPipeline(qwen2, "CPU", kv_window_shares="8:0.75,full:0.25", **room)
    stats = pipe.kv_stats()
    assert stats["kv_pool_blocks"] == {"8": 8, "full": 8}
    assert stats["kv_window_shares"] == {"8": 0.75, "full": 0.25}
    assert stats["kv_window_shares_given"] is True
    assert pipe.config.kv_window_shares == "8:0.75,full:0.25"
    # the windowed layer's cache tensors follow its pool
    assert pipe.runner.cache.tensors["key_cache.1"].get_shape()[0] == 8
    assert stats["kv_bytes_allocated"] == default["kv_bytes_allocated"]
    for ids in (_ids(100), _ids(60, 1), np.concatenate([_ids(100), _ids(20, 2)])):
        assert _run(pipe, ids).tokens == fresh(ids, 8).tokens
    assert pipe.kv_stats()["reused_tokens"] == 96
    pipe.runner.blocks.check_invariants()


def test_window_shares_split_the_host_tier_too(qwen2):
    pipe = LLMPipeline(
        qwen2, "CPU", prefix_cache_host_tokens=128, kv_window_shares="0,1", **SETTINGS
    )
    assert pipe.kv_stats()["host_tier_blocks"] == {"8": 0, "full": 8}


def test_window_shares_from_the_environment(qwen2, monkeypatch):
    """NPUW_KV_WINDOW_SIZE_SHARES, positional in ascending window order (full last); the
    setting wins over it, with a warning."""
    monkeypatch.setenv(SHARES_ENV, "0.75,0.25")
    pipe = LLMPipeline(qwen2, "CPU", prefix_cache_tokens=128, **SETTINGS)
    assert pipe.kv_stats()["kv_pool_blocks"] == {"8": 8, "full": 8}
    with pytest.warns(UserWarning, match=f"{SHARES_ENV}='0.75,0.25' ignored"):
        pipe = LLMPipeline(
            qwen2, "CPU", prefix_cache_tokens=128, kv_window_shares="0,1", **SETTINGS
        )
    assert pipe.kv_stats()["kv_pool_blocks"] == {"8": 2, "full": 14}
    monkeypatch.setenv(SHARES_ENV, "8:0.5,16:0.5")
    with pytest.raises(ValueError, match=f"{SHARES_ENV} names window 16 .* 8, full"):
        LLMPipeline(qwen2, "CPU", prefix_cache_tokens=128, **SETTINGS)


BAD_SHARES = {
    "0.5,0.6": "sum to 1.1, not 1",
    "16:0.5,full:0.5": "names window 16 but the model's windows are 8, full",
    "0.2,0.3,0.5": "has 3 shares but the model has 2 window sizes",
    "half,half": "is not a number",
    "8:0.5,0.5": "mixes keyed and positional",
}


@pytest.mark.parametrize("shares", sorted(BAD_SHARES))
def test_bad_shares_are_refused_by_name_and_the_pipeline_stays_usable(qwen2, shares):
    with pytest.raises(ValueError, match=SHARES_NAME) as error:
        LLMPipeline(qwen2, "CPU", prefix_cache_tokens=64, kv_window_shares=shares, **SETTINGS)
    assert BAD_SHARES[shares] in str(error.value)
    pipe = LLMPipeline(qwen2, "CPU", prefix_cache_tokens=64, **SETTINGS)
    first = _run(pipe, _ids(70)).tokens
    before = pipe.kv_stats()["kv_pool_blocks"]
    with pytest.raises(ValueError, match=SHARES_NAME) as error:
        pipe.set_kv_window_shares(shares)
    assert BAD_SHARES[shares] in str(error.value)
    assert pipe.kv_stats()["kv_pool_blocks"] == before and pipe.config.kv_window_shares is None
    assert _run(pipe, _ids(70)).tokens == first
    assert pipe.kv_stats()["reused_tokens"] == 64  # the cache was kept, not rebuilt


def test_shares_set_on_a_live_pipeline_resize_the_pools(qwen2, fresh):
    pipe = LLMPipeline(qwen2, "CPU", prefix_cache_tokens=128, **SETTINGS)
    pipe.set_kv_window_shares({8: 0.75, None: 0.25})
    assert pipe.kv_stats()["kv_pool_blocks"] == {"8": 8, "full": 8}
    assert pipe.config.kv_window_shares == "8:0.75,full:0.25"
    ids = _ids(90)
    assert _run(pipe, ids).tokens == fresh(ids, 8).tokens
    pipe.set_kv_window_shares(None)
    assert pipe.kv_stats()["kv_pool_blocks"] == {"8": 6, "full": 10}
    assert _run(pipe, ids).tokens == fresh(ids, 8).tokens


def test_shares_without_room_to_split_warn(qwen2):
    with pytest.warns(RuntimeWarning, match="nothing to split"):
        pipe = LLMPipeline(qwen2, "CPU", kv_window_shares="0.5,0.5", **SETTINGS)
    assert pipe.kv_stats()["kv_pool_blocks"] == {"8": 2, "full": 6}


@pytest.mark.parametrize(
    "device, extra",
    [("CPU", {"attention_backend": "sdpa"}), ("NPU", {}), ("CPU", {"kv_precision": "f16"})],
)
@pytest.mark.parametrize(
    "setting", [{"prefix_cache_host_tokens": 64}, {"NPUW_KV_WINDOW_SIZE_SHARES": "1"}]
)
def test_the_static_path_refuses_the_tiers_by_name(device, extra, setting):
    """Never dropped silently: the static-shape path (NPU, sdpa, or what auto picks for an
    explicit float KV precision) refuses them, naming the setting and the path they need."""
    name = "prefix_cache_host_tokens" if "prefix_cache_host_tokens" in setting else SHARES_NAME
    with pytest.raises(ValueError, match=f"{name} .*applies to attention_backend='pa'"):
        PipelineConfig.from_kwargs(device, **extra, **setting)


def test_the_static_path_refuses_shares_at_run_time_and_warns_on_the_variable(qwen2, monkeypatch):
    monkeypatch.setenv(SHARES_ENV, "1")
    with pytest.warns(RuntimeWarning, match=f"{SHARES_ENV} ignored"):
        pipe = LLMPipeline(qwen2, "CPU", attention_backend="sdpa", **SETTINGS)
    with pytest.raises(ValueError, match=f"{SHARES_NAME} .*applies to attention_backend='pa'"):
        pipe.set_kv_window_shares("1")


# -- the chat system prompt -------------------------------------------------------------------
def _chat_then_flood(pipe: LLMPipeline, chat: bool) -> None:
    """A first turn under SYSTEM (as a chat, or as the same ids given raw), then three other
    prompts that need the pools' blocks (given as messages: in a chat, token ids would be its
    next turn)."""
    if chat:
        pipe.start_chat(SYSTEM)
        _run(pipe, "Hello there", 4)
    else:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        text = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = pipe.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]
        _run(pipe, ids.astype(np.int64), 4)
        assert pipe.kv_stats()["priority_held_tokens"] == 0
        assert pipe.kv_stats()["priority_held_blocks"] == 0
    for salt in (1, 2, 3):  # messages: prompts of their own, not turns of the chat
        text = pipe.tokenizer.decode(_ids(80, salt).tolist())
        _run(pipe, [{"role": "user", "content": text}], 4)


def test_chat_system_prompt_blocks_are_evicted_last(qwen2, fresh):
    """The system prompt's whole blocks outlive three other prompts in a chat; the same
    tokens outside a chat (default priority, least recently used) do not."""
    pipe = LLMPipeline(qwen2, "CPU", prefix_cache_tokens=BLOCK, **SETTINGS)
    _chat_then_flood(pipe, chat=True)
    stats = pipe.kv_stats()
    assert stats["priority_held_blocks"] >= 2  # SYSTEM's two blocks of the full layer
    pipe.finish_chat()
    pipe.start_chat(SYSTEM)
    ids = pipe.encode("Another question", chat=True)
    ours = _run(pipe, "Another question", 4)
    stats = pipe.kv_stats()
    assert stats["priority_held_tokens"] == 2 * BLOCK
    assert stats["reused_tokens"] == 2 * BLOCK
    assert list(ours.tokens) == list(fresh(ids, 4).tokens)
    pipe.runner.blocks.check_invariants()

    plain = LLMPipeline(qwen2, "CPU", prefix_cache_tokens=BLOCK, **SETTINGS)
    _chat_then_flood(plain, chat=False)
    plain.start_chat(SYSTEM)
    _run(plain, "Another question", 4)
    assert plain.kv_stats()["reused_tokens"] == 0


def test_chat_history_input_holds_its_system_prompt(qwen2):
    """Messages given to generate (genai's ChatHistory form) hold their system prompt too."""
    pipe = LLMPipeline(qwen2, "CPU", **SETTINGS)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    pipe.generate(messages, max_new_tokens=2, ignore_eos=True)
    assert pipe.kv_stats()["priority_held_tokens"] == 2 * BLOCK
    assert pipe.kv_stats()["priority_held_blocks"] >= 2
    full = pipe.runner.blocks.windows[pipe.runner.capacity].blocks
    assert sum(b.priority == SYSTEM_PRIORITY for b in full) == 2
    _run(pipe, "no system prompt here", 2)  # a plain prompt holds nothing
    assert pipe.kv_stats()["priority_held_tokens"] == 0
