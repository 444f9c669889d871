"""End to end on the real SmolLM2: our chunked static pipeline vs exact f32 references."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHUNK, REPORT, make_pipe

from npuw_kv.model.transforms import tail_input

LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 1000]
NEW_TOKENS = 32


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_tokens_match_genai(any_pipe, text_ids, genai_reference, reference_logits, length):
    ids = text_ids(length)
    result = any_pipe.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    expected = genai_reference(ids, NEW_TOKENS)
    pairs = enumerate(zip(result.tokens, expected, strict=True))
    first_diff = next((i for i, (a, b) in pairs if a != b), None)
    delta = float(np.abs(result.first_logits - reference_logits(ids)).max())
    agreement = "all equal" if first_diff is None else f"first divergence at {first_diff}"
    REPORT.append(
        f"{any_pipe.label} prompt {length:4d}, {NEW_TOKENS} new tokens: {agreement}; "
        f"max |dlogit| at the first generated position {delta:.2e}"
    )
    assert first_diff is None, f"diverges at generated token {first_diff}"
    assert len(result.tokens) == NEW_TOKENS
    # on NPU too: the f32 hint turns off NPUW's f16 tensors between its sub-graphs
    assert delta < 1e-3


def test_npuw_f16_intermediates_round_only_before_the_head(smol_dir, text_ids, reference_logits):
    """NPUW's f16 tensors between sub-graphs (``NPUW_F16IC``, its default) round the logits
    only where the LM head is one of its sub-graphs: the hidden state reaches it as f16.

    With the head cut out (model/split.py, the default) they cost nothing measurable; with the
    model whole they do, which is why the f32 hint still turns them off (runtime/compile.py).
    If the rounding came from elsewhere, one of the two bounds would fail.
    """
    ids = text_ids(CHUNK + 1)
    for shared_head, rounds in (("YES", False), ("NO", True)):
        pipe = make_pipe(smol_dir, "NPU", NPUW_F16IC="YES", shared_head=shared_head)
        result = pipe.generate(ids, max_new_tokens=2, ignore_eos=True)
        error = float(np.abs(result.first_logits - reference_logits(ids)).max())
        assert (error > 1e-3) == rounds, (shared_head, error)


def test_prefill_views_share_the_generate_buffer(smol_pipe, text_ids):
    # a fresh prompt on the chunk grid (not a continuation of what another test left cached,
    # whose chunk may cross a KV block edge and be staged)
    smol_pipe.runner.prefix_reuse = False
    try:
        smol_pipe.generate(text_ids(CHUNK + 7), max_new_tokens=4, ignore_eos=True)
    finally:
        smol_pipe.runner.prefix_reuse = True
    runner = smol_pipe.runner
    requests = runner.requests

    def address(tensor) -> int:
        return tensor.data.__array_interface__["data"][0]

    cache = runner.cache
    for port in runner.layout.ports:
        prefill_past = requests.prefill.get_tensor(port.input_name)
        if requests.shared_weights:
            buffer = cache.buffers[port.input_name]
            # one compiled model, past split and sliced: the prefill reads the whole buffer
            # (contiguous) up to its mask, the generate step binds it as the tail
            tail = tail_input(port.input_name)
            generate_tail = requests.generate.get_tensor(tail)
            for whole in (prefill_past, generate_tail):
                assert whole.is_continuous() and address(whole) == buffer.ctypes.data
                assert whole.data.shape[2] == runner.cache.capacity
            assert requests.prefill.get_tensor(tail).data.shape[2] == 0
            assert requests.generate.get_tensor(port.input_name).data.shape[2] == 0
        else:
            # static models: the buffer is cut into blocks where the models' pasts end; the
            # prefill reads slots [0, MAX_PROMPT_LEN - C) as the first blocks themselves, one
            # dense input each, and the generate step all of them: no copy of them
            name, blocks = port.input_name, cache.blocks[port.input_name]
            assert cache.edges and cache.edges[-1] == runner.shapes.prefill_past
            for request, parts in (
                (requests.prefill, len(blocks) - 1),
                (requests.generate, len(blocks)),
            ):
                for part, (_, block) in enumerate(blocks[:parts]):
                    past = request.get_tensor(tail_input(name, part))
                    assert past.is_continuous() and address(past) == block.ctypes.data
                    assert past.data.shape == block.shape
            inputs = {i.get_any_name() for i in requests.prefill.get_compiled_model().inputs}
            assert tail_input(name, len(blocks) - 1) not in inputs  # it stops at the last edge
    stats = smol_pipe.kv_stats()
    assert stats["switch_host_bytes_copied"] == 0
    assert stats["host_bytes_copied"] == 0
    assert stats["tokens_in_cache"] == CHUNK + 7 + 3


def test_copy_binding_matches_roi_and_counts_bytes(smol_dir, text_ids):
    ids = text_ids(CHUNK + 3)
    roi = make_pipe(smol_dir, "CPU", attention_backend="sdpa").generate(
        ids, max_new_tokens=8, ignore_eos=True
    )
    copy_pipe = make_pipe(smol_dir, "CPU", kv_binding="copy")
    copy_pipe.runner.prefix_reuse = False  # the counts below are those of a cold prefill
    try:
        copied = copy_pipe.generate(ids, max_new_tokens=8, ignore_eos=True)
    finally:
        copy_pipe.runner.prefix_reuse = True
    assert copied.tokens == roi.tokens
    np.testing.assert_allclose(copied.first_logits, roi.first_logits, atol=1e-4)
    stats = copy_pipe.kv_stats()
    per_token = stats["kv_bytes_per_token"]
    # prefill: both chunks' new rows come out through staging (2C), and chunk 2 first syncs
    # the C slots chunk 1 wrote; the switch then stages the whole padded prompt (2C slots)
    assert stats["prefill_host_bytes_copied"] == 3 * CHUNK * per_token
    assert stats["switch_host_bytes_copied"] == 2 * CHUNK * per_token
    assert stats["host_bytes_copied"] > stats["switch_host_bytes_copied"]
    # the generate step reads its staging through the unsliced tail (no slice copy per step),
    # the prefill through the sliced past; the other input is empty
    requests, port = copy_pipe.runner.requests, copy_pipe.runner.layout.ports[0].input_name
    tail = tail_input(port)
    assert requests.generate.get_tensor(port).data.shape[2] == 0
    assert requests.generate.get_tensor(tail).data.shape[2] == copy_pipe.runner.cache.capacity
    assert requests.prefill.get_tensor(tail).data.shape[2] == 0
    assert requests.prefill.get_tensor(port).data.shape[2] == copy_pipe.runner.prefill_past


def test_kv_capacity_ends_with_length(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU")
    ids = text_ids(pipe.config.max_prompt_len)
    result = pipe.generate(ids, max_new_tokens=10_000, ignore_eos=True)
    assert result.finish_reason == "length"
    # every slot up to TOTAL is used: prompt + generated = MAX_PROMPT + MIN_RESPONSE
    assert len(ids) + len(result.tokens) == pipe.config.total_len + 1
    again = pipe.generate(text_ids(5), max_new_tokens=3, ignore_eos=True)
    assert len(again.tokens) == 3


@pytest.mark.parametrize("backend", ["pa", "sdpa"])
def test_a_stop_token_alone_ends_at_the_kv_capacity(smol_dir, text_ids, backend):
    """genai's test_sampling `stop_token_ids`: no length limit, only a stop token that never
    comes (nor the EOS); the answer ends at the sequence's room ("length"), no crash, and the
    pipeline goes on."""
    pipe = make_pipe(smol_dir, "CPU", attention_backend=backend)
    never = pipe.engine.vocab_size - 1
    ids = text_ids(pipe.config.max_prompt_len - 8)
    result = pipe.generate(ids, stop_token_ids={never}, eos_token_id=never)
    assert result.finish_reason == "length" and never not in result.tokens
    # the room each path gives a sequence: at least MIN_RESPONSE_LEN + 1, at most the cache
    assert len(result.tokens) >= pipe.config.min_response_len + 1
    assert len(ids) + len(result.tokens) <= pipe.config.total_len + 1
    assert len(pipe.generate(text_ids(5), max_new_tokens=3, ignore_eos=True).tokens) == 3


@pytest.mark.device_defaults
def test_auto_kv_precision_is_lossless_at_device_defaults(smol_dir, text_ids):
    """On the static-shape path ``auto`` stores KV in the CPU's compute precision (bf16 where
    the CPU has it)."""
    import openvino as ov

    from npuw_kv.pipeline import LLMPipeline

    shapes = dict(
        prefill_chunk_size=CHUNK, max_prompt_len=512, min_response_len=32, attention_backend="sdpa"
    )
    auto = LLMPipeline(smol_dir, "CPU", **shapes)
    f32 = LLMPipeline(smol_dir, "CPU", kv_precision="f32", **shapes)
    # the plugin's own default compute precision (bf16 only where the CPU has it)
    has_bf16 = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT") == ov.Type.bf16
    assert auto.kv_stats()["kv_precision"] == ("bf16" if has_bf16 else "f32")
    ids = text_ids(CHUNK + 40)
    a = auto.generate(ids, max_new_tokens=16, ignore_eos=True)
    b = f32.generate(ids, max_new_tokens=16, ignore_eos=True)
    assert a.tokens == b.tokens
    assert float(np.abs(a.first_logits - b.first_logits).max()) == 0.0
    if has_bf16:
        assert auto.kv_stats()["kv_bytes_allocated"] * 2 == f32.kv_stats()["kv_bytes_allocated"]
