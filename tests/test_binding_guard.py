"""kv_binding='contiguous': bind a KV view directly only when it is dense, stage the rest.

A device that refuses strided tensors must get dense ones, but a contiguous view already is one.
A ``[1, H, L, D]`` buffer's slot range is contiguous for H == 1 (any range) and, for H > 1, only
as the whole buffer or a whole block of it.  So with 1 KV head nothing is copied; with 2, every
present output view is staged, and so is each prefill past ``[0, P)`` where the buffer is one
block (the NPU path cuts it where the models' pasts end, so they are read in place there), while
the generate past (the whole buffer) is read in place.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import numpy as np
import openvino as ov
import pytest
from conftest import RecordingRequest, own_copies

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.kv.cache import KVSpec, SharedKVCache
from npuw_kv.kv.copy import CopyCounter
from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.model.source import resolve_model
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime import build
from npuw_kv.runtime.shapes import shapes_for
from npuw_kv.runtime.static.binding import BoundPort, KVBinding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.npu_path  # also run under the NPU rules double

C = 16
MAX_PROMPT = 64
MIN_RESPONSE = 40
CAPACITY = MAX_PROMPT + MIN_RESPONSE - 1  # slots of the shared buffer
LAYERS, HEAD_DIM = 2, 16  # make_tiny_gguf's defaults: hidden 64 / 4 query heads
PROMPT = (np.arange(40, dtype=np.int64) * 7919 + 11) % 49000 + 100  # 3 chunks, 8 pad slots


# -- KVBinding alone: a request that only records what it is given ---------------------------
def bind(heads: int, mode: str, past: int, new: int, capacity: int = 12):
    cache = SharedKVCache([KVSpec("k", heads, 4), KVSpec("v", heads, 4)], capacity, "f32")
    for i, buf in enumerate(cache.buffers.values()):
        buf[...] = np.arange(buf.size, dtype=np.float32).reshape(buf.shape) + 1000 * i
    request, counter = RecordingRequest(), CopyCounter()
    ports = [BoundPort("k", 0), BoundPort("v", 1)]
    binding = KVBinding(
        request,  # type: ignore[arg-type]
        ports,
        cache,
        past_len=past,
        new_tokens=new,
        mode=mode,
        counter=counter,
    )
    return binding, request, cache, counter


def shares(tensor: ov.Tensor, cache: SharedKVCache, name: str) -> bool:
    return np.shares_memory(tensor.data, cache.buffers[name])


@pytest.mark.parametrize(
    ("heads", "mode", "past_path", "out_path"),
    [
        (1, "contiguous", "direct", "direct"),  # H == 1: every slot range is dense
        (2, "contiguous", "staged", "staged"),  # H > 1: [0, 6) and [6, 8) are strided
        (2, "roi", "direct", "direct"),  # the device takes strided views
        (1, "copy", "staged", "staged"),  # everything staged, dense or not
    ],
)
def test_guard_decides_per_tensor(heads, mode, past_path, out_path):
    binding, request, cache, counter = bind(heads, mode, past=6, new=2)
    assert binding.past_paths == {"k": past_path, "v": past_path}
    assert shares(request.inputs["k"], cache, "k") == (past_path == "direct")
    binding.before((6, 8), 6)
    assert binding.output_paths == {"k": out_path, "v": out_path}
    assert shares(request.outputs[1], cache, "v") == (out_path == "direct")
    row_bytes = heads * 4 * 4  # one slot of one buffer: heads x head_dim x f32
    synced = 6 * row_bytes * 2 if past_path == "staged" else 0
    assert counter.bytes == synced
    # the past the request reads holds the cache's rows, staged or not
    np.testing.assert_array_equal(request.inputs["v"].data, cache.rows("v", 0, 6))
    request.outputs[0].data[...] = -1.0  # what the device writes
    binding.after((6, 8))
    assert (cache.rows("k", 6, 8) == -1).all() and (cache.rows("k", 8, 9) != -1).all()
    assert counter.bytes == synced + (2 * row_bytes * 2 if out_path == "staged" else 0)
    if out_path == "staged":
        assert (binding.outputs_direct, binding.outputs_staged) == (0, 2)
    else:
        assert (binding.outputs_direct, binding.outputs_staged) == (2, 0)


def test_contiguous_binds_the_whole_buffer_and_the_scratch_directly():
    binding, request, cache, counter = bind(2, "contiguous", past=12, new=1)
    assert binding.past_paths == {"k": "direct", "v": "direct"}  # the whole buffer: dense
    assert request.inputs["k"].data.ctypes.data == cache.buffers["k"].ctypes.data
    binding.before((5, 6), 5)  # one strided slot
    assert binding.output_paths == {"k": "staged", "v": "staged"}
    binding.after((5, 6))
    assert counter.bytes == 2 * 2 * 4 * 4  # 1 row x 2 buffers x 2 heads x head_dim 4 x f32
    binding.before((12, 13), 12)  # the last step: its KV goes to a dense scratch
    assert binding.output_paths == {"k": "direct", "v": "direct"}
    assert not shares(request.outputs[0], cache, "k")
    binding.after((12, 13))
    assert counter.bytes == 2 * 2 * 4 * 4
    assert (binding.outputs_direct, binding.outputs_staged) == (2, 2)
    binding.reset()
    assert (binding.outputs_direct, binding.outputs_staged) == (0, 0)


def test_staged_past_holds_the_rows_earlier_chunks_wrote():
    # H = 2 prefill: past [0, 8) staged; chunks of 4 write [0, 4), [4, 8), [8, 12)
    binding, request, cache, counter = bind(2, "contiguous", past=8, new=4)
    for k in range(3):
        binding.before((4 * k, 4 * k + 4), 4 * k)
        request.outputs[0].data[...] = k  # the chunk's K rows
        request.outputs[1].data[...] = -k
        binding.after((4 * k, 4 * k + 4))
    np.testing.assert_array_equal(
        cache.rows("k", 0, 12),
        np.repeat([0.0, 1, 2], 4)[None, None, :, None] * np.ones((1, 2, 12, 4)),
    )
    np.testing.assert_array_equal(request.inputs["v"].data[:, :, 4:8], cache.rows("v", 4, 8))
    row = 2 * 4 * 4
    assert counter.bytes == 2 * row * (0 + 4 + 4) + 2 * row * 12  # past 4 + 4 rows, outputs 12


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="kv_binding 'mmap'"):
        bind(1, "mmap", past=4, new=1)


# -- real tiny models through the NPU pipeline (NPUW on CPU) ---------------------------------
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llamas with 1 and with 2 KV heads, converted once for the module."""
    made: dict[int, Path] = {}

    def get(kv_heads: int) -> Path:
        if kv_heads not in made:
            root = tmp_path_factory.mktemp(f"tiny_kv{kv_heads}")
            gguf = make_tiny_gguf(
                root / "tiny.gguf", kv_heads=kv_heads, std=0.2, seed=3, dtype="Q8_0"
            )
            made[kv_heads] = resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)
        return made[kv_heads]

    return get


def _one_block(decided, capacity: int) -> StaticShapes:
    """The static shapes with the KV buffer as one block."""
    return shapes_for(decided.config, capacity)


@pytest.fixture(scope="module")
def pipes(tiny_dirs):
    made: dict[tuple[int, str, bool], LLMPipeline] = {}

    def get(kv_heads: int, kv_binding: str, blocks: bool = True) -> LLMPipeline:
        """``blocks``: the NPU path's KV buffer cut where the models' pasts end (its default,
        so every past is dense); False: one block, so each past but the whole buffer is a
        strided view, as it is where V is stored transposed."""
        if (kv_heads, kv_binding, blocks) not in made:
            shapes = build.static_shapes if blocks else _one_block
            with mock.patch.object(build, "static_shapes", shapes):
                made[kv_heads, kv_binding, blocks] = LLMPipeline(
                    tiny_dirs(kv_heads),
                    "NPU",
                    prefill_chunk_size=C,
                    max_prompt_len=MAX_PROMPT,
                    min_response_len=MIN_RESPONSE,
                    kv_binding=kv_binding,
                    prefix_reuse=False,  # every prompt runs fresh: the same bytes each time
                    NPUW_ONLINE_PIPELINE="NONE",  # as tests/test_tiny_model.py: this tiny graph
                    **EXACT_F32,
                )
        return made[kv_heads, kv_binding, blocks]

    return get


def bindings(runner, phase: str) -> list[KVBinding]:
    """A phase's bindings: one per static model variant by past length where the runner has
    them (pyramid prefill, generate ladder), else its one binding."""
    variants = getattr(runner, f"{phase}_variants", None)
    return [v.binding for v in variants] if variants else [getattr(runner, f"{phase}_binding")]


def outputs(runner, phase: str) -> tuple[int, int]:
    """(direct, staged) output bindings of a phase during the last prompt."""
    found = bindings(runner, phase)
    return sum(b.outputs_direct for b in found), sum(b.outputs_staged for b in found)


def test_one_kv_head_binds_everything_directly(pipes):
    roi, guarded = pipes(1, "roi"), pipes(1, "contiguous")
    assert guarded.layout.num_kv_heads == 1 and guarded.runner.kv_binding == "contiguous"
    expected = roi.generate(PROMPT, max_new_tokens=8, ignore_eos=True).tokens
    assert guarded.generate(PROMPT, max_new_tokens=8, ignore_eos=True).tokens == expected
    assert len(set(expected)) > 2  # a meaningful comparison, not a constant loop
    runner = guarded.runner
    for binding in bindings(runner, "prefill") + bindings(runner, "generate"):
        # [0, 48), [0, 16), ...: dense; the model of no past has no past inputs
        assert set(binding.past_paths.values()) == ({"direct"} if binding.past_len else set())
    ports = len(guarded.layout.ports)  # K and V of each layer
    assert outputs(runner, "prefill") == (3 * ports, 0)  # 3 chunks
    assert outputs(runner, "generate") == (7 * ports, 0)  # 8 tokens: 7 steps
    assert runner.host_bytes_copied == 0 and guarded.kv_stats()["host_bytes_copied"] == 0


# Prefill past rows synced into staging (per buffer).  The prompt runs 3 chunks, at slots 0, 16
# and 32; a prefill model's staged past is filled from slot 0 up to its chunk's start.  One
# prefill model (past 48): [0, 32) by chunk 2.  Pyramid (pasts 0, 16, 32, 48; the chunk at slot
# s on the smallest past >= s): [0, 16) for chunk 1's model, [0, 32) for chunk 2's.  The lean
# pyramid (the default here, with no generate variant: pasts 0, 16, 48) runs chunk 1 on the
# past-16 model and chunk 2 on the past-48 one: again [0, 16) and [0, 32).
PAST_ROWS = {(48, 48, 48): 32, (0, 16, 32): 16 + 32, (0, 16, 48): 16 + 32}


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize(
    ("new_tokens", "kept_steps"),
    [
        (8, 7),  # the first token comes from the prefill
        # to a full cache: the prompt ends at slot 48, 55 steps fill [48, 103), the 56th writes
        # the dense scratch (bound directly, nothing copied)
        (57, 55),
    ],
)
def test_two_kv_heads_stage_only_strided_views(pipes, new_tokens, kept_steps, blocks):
    roi, guarded = pipes(2, "roi", blocks), pipes(2, "contiguous", blocks)
    expected = roi.generate(PROMPT, max_new_tokens=new_tokens, ignore_eos=True).tokens
    result = guarded.generate(PROMPT, max_new_tokens=new_tokens, ignore_eos=True)
    assert result.tokens == expected and len(expected) == new_tokens
    assert len(set(expected)) > 2
    runner, layout = guarded.runner, guarded.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (LAYERS, 2, HEAD_DIM)
    ports = len(layout.ports)
    assert ports == 2 * LAYERS
    assert runner.cache.edges == ((16, 48) if blocks else ())  # the lean prefill's pasts
    for binding in bindings(runner, "prefill") + bindings(runner, "generate"):
        # a past [0, p) of 2 heads is strided unless empty or the whole buffer, or whole blocks
        if binding.past_len == 0:  # the model of no past has no past inputs
            assert not binding.past_paths
            continue
        dense = blocks or binding.past_len == CAPACITY
        assert set(binding.past_paths.values()) == {"direct" if dense else "staged"}
    assert runner.generate_binding.past_paths  # the whole buffer ...
    assert set(runner.generate_binding.past_paths.values()) == {"direct"}  # ... read in place
    # chunk 0 writes [0, 16), with blocks the whole first block: dense, written in place
    staged_chunks = 2 if blocks else 3
    assert outputs(runner, "prefill") == ((3 - staged_chunks) * ports, staged_chunks * ports)
    scratch_steps = new_tokens - 1 - kept_steps
    assert outputs(runner, "generate") == (scratch_steps * ports, kept_steps * ports)
    pasts = tuple(runner.stats().get("prefill_pasts_used", [runner.prefill_past] * 3))
    past_rows = 0 if blocks else PAST_ROWS[pasts]
    # bytes of one slot of one buffer: heads x head_dim x itemsize (f32)
    row_bytes = layout.num_kv_heads * layout.head_dim * runner.cache.dtype.itemsize
    assert row_bytes == 2 * 16 * 4
    prefill_bytes = (past_rows + staged_chunks * C) * ports * row_bytes  # + the chunks' rows
    assert prefill_bytes == {0: 16384, 32: 40960, 48: 49152}[past_rows]
    stats = guarded.kv_stats()
    assert stats["prefill_host_bytes_copied"] == prefill_bytes
    assert stats["switch_host_bytes_copied"] == 0  # the generate past is read in place
    # + one row per step that keeps its KV
    assert runner.host_bytes_copied == prefill_bytes + kept_steps * ports * row_bytes
    assert runner.host_bytes_copied - prefill_bytes == {8: 3584, 57: 28160}[new_tokens]
    assert own_copies(roi.kv_stats()) == 0
