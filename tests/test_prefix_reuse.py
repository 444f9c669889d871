"""A prompt that starts with tokens still in the KV cache runs only the rest (chat turns).

The static-shape path's slot rules; the PagedAttention backend's reuse is in test_paged.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHUNK, MAX_PROMPT, make_pipe, own_copies

# the NPU case also runs under the NPU rules double (pyproject.toml's npu_path marker)
NPU_CASE = pytest.param("NPU", {}, marks=pytest.mark.npu_path)


def _fresh(pipe, ids, new_tokens):
    """``ids`` with reuse off: every chunk from scratch, token 0 at its front-padded slot."""
    pipe.runner.prefix_reuse = False
    try:
        return pipe.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    finally:
        pipe.runner.prefix_reuse = True


@pytest.mark.parametrize(
    ("device", "extra"),
    [("CPU", {"attention_backend": "sdpa"}), ("CPU", {"kv_binding": "copy"}), NPU_CASE],
)
def test_continuation_gives_the_fresh_prefill_result(smol_dir, text_ids, device, extra):
    pipe = make_pipe(smol_dir, device, **extra)
    other = text_ids(1000)[600:]  # text the first prompt does not contain
    first = _fresh(pipe, text_ids(300), 16)
    cached = [*text_ids(300).tolist(), *first.tokens[:-1]]  # the last token was never fed

    # a chat turn: everything cached, then new text -> one chunk instead of two
    turn = np.array([*cached, *other[:100]], np.int64)
    ours = pipe.generate(turn, max_new_tokens=16, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == len(cached)
    stats = pipe.kv_stats()  # the static path keeps this turn's tokens, the last one unfed
    assert stats["cached_tokens"] == stats["tokens_in_cache"] == len(turn) + 15
    if extra.get("kv_binding") != "copy":
        assert own_copies(pipe.kv_stats()) == 0
    fresh = _fresh(pipe, turn, 16)
    assert pipe.kv_stats()["reused_tokens"] == 0
    assert ours.tokens == fresh.tokens
    assert np.abs(ours.first_logits - fresh.first_logits).max() < 1e-4

    # diverging half-way through the cached tokens: reuse up to there only
    pipe.generate(text_ids(300), max_new_tokens=4, ignore_eos=True)  # cache: these 300, then 3
    branch = np.array([*text_ids(300)[:200], *other[:200]], np.int64)
    ours = pipe.generate(branch, max_new_tokens=16, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 200
    fresh = _fresh(pipe, branch, 16)
    assert ours.tokens == fresh.tokens
    assert np.abs(ours.first_logits - fresh.first_logits).max() < 1e-4


def test_no_continuation_past_the_prompt_part_of_the_cache(smol_dir, text_ids):
    """Token i keeps slot first_slot + i, so a prompt that would end beyond MAX_PROMPT_LEN
    there (though it fits from slot 0), or with no chunk to save, is run from scratch."""
    pipe = make_pipe(smol_dir, "CPU", attention_backend="sdpa")
    ids = text_ids(MAX_PROMPT)
    _fresh(pipe, ids[:300], 1)  # token 0 at slot 212: 1024 - 212 slots left
    pipe.generate(ids[: MAX_PROMPT - 100], max_new_tokens=1)
    assert pipe.kv_stats()["reused_tokens"] == 0
    pipe.generate(ids[:CHUNK], max_new_tokens=1)
    pipe.generate(ids[: CHUNK + 1], max_new_tokens=1)  # two chunks fresh, one as continuation
    assert pipe.kv_stats()["reused_tokens"] == CHUNK
    pipe.generate(ids[:CHUNK], max_new_tokens=1)  # a prefix of the cache: still one chunk
    assert pipe.kv_stats()["reused_tokens"] == 0


def test_prefix_reuse_can_be_turned_off(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU", PREFIX_REUSE="NO")
    assert pipe.runner.prefix_reuse is False
    first = pipe.generate(text_ids(300), max_new_tokens=4, ignore_eos=True)
    pipe.generate(np.array([*text_ids(300), *first.tokens[:-1], 7, 8], np.int64), max_new_tokens=2)
    assert pipe.kv_stats()["reused_tokens"] == 0


def test_a_continuation_may_run_chunks_anywhere_in_the_cache(smol_dir, text_ids):
    """Chunks [300, 556) and [556, 812): with the whole buffer bound on CPU (the past sliced by
    the mask) no slot range is out of reach, so both devices reuse the 300 cached tokens and
    give a fresh prefill's tokens."""
    ids = text_ids(600)
    for device in ("CPU", "NPU"):
        pipe = make_pipe(smol_dir, device, attention_backend="sdpa")
        _fresh(pipe, ids[:300], 1)  # token 0 at slot 212, whatever ran before
        reused = pipe.generate(ids, max_new_tokens=4, ignore_eos=True)  # ends at slot 812
        assert pipe.kv_stats()["reused_tokens"] == 300, device
        assert reused.tokens == _fresh(pipe, ids, 4).tokens, device


@pytest.mark.parametrize(
    ("device", "extra"),
    [("CPU", {"attention_backend": "sdpa"}), ("CPU", {"kv_binding": "copy"}), NPU_CASE],
)
def test_host_prefix_store_brings_back_an_earlier_prompt(smol_dir, text_ids, device, extra):
    """With ``prefix_cache_tokens`` the static-shape path keeps earlier prompts' whole blocks
    on the host: a question on document A after one on document B starts from A's blocks,
    copied back into the slots, and gives the fresh prefill's result."""
    pipe = make_pipe(smol_dir, device, prefix_cache_tokens=1024, **extra)
    store = pipe.runner.prefix_store
    doc_a, doc_b = text_ids(300), text_ids(1000)[600:900]
    pipe.generate(doc_a, max_new_tokens=16, ignore_eos=True)
    pipe.generate(doc_b, max_new_tokens=4, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 0  # B shares nothing with A
    # A and its 15 fed answer tokens: 315 tokens, 9 whole blocks of 32, are in the store
    assert store.cached_tokens >= 288

    question = np.array([*doc_a, *text_ids(1000)[900:1000]], np.int64)
    ours = pipe.generate(question, max_new_tokens=16, ignore_eos=True)
    assert pipe.kv_stats()["reused_tokens"] == 288  # one chunk to run instead of two
    assert pipe.kv_stats()["host_bytes_copied"] > 0  # the blocks came back through the host
    fresh = _fresh(pipe, question, 16)
    assert ours.tokens == fresh.tokens
    assert np.abs(ours.first_logits - fresh.first_logits).max() < 1e-4


def test_host_prefix_store_stays_within_its_room(smol_dir, text_ids):
    """The store holds whole blocks up to its room; older prefixes are evicted (LRU)."""
    pipe = make_pipe(smol_dir, "CPU", attention_backend="sdpa", prefix_cache_tokens=100)
    store = pipe.runner.prefix_store
    # 96 tokens of prefixes, and one block for the partial block a restore claims
    assert store.capacity == 96 and store.nbytes == 128 * pipe.kv_stats()["kv_bytes_per_token"]
    prompts = [text_ids(1000)[start : start + 150] for start in (0, 200, 400)]
    for ids in prompts:
        pipe.generate(ids, max_new_tokens=2, ignore_eos=True)
    # each prompt is stored when the next one starts, its first 96 tokens at most: the
    # second prompt's three blocks pushed out the first's last two (a chain shrinks from its
    # end); the third is still in its slots only
    assert store.cached_tokens == 128
    assert store.lookup(prompts[1]) == 96 and store.lookup(prompts[0]) == 32
    assert store.lookup(prompts[2]) == 0
    store.blocks.check_invariants()
