"""V stored transposed, ``[1, H, D, S]`` (optimize_v_tensors / NPUW_LLM_OPTIMIZE_V_TENSORS).

The graph rewrite, the shared buffer cut along axis 3, the contiguity guard on such views, the
mixed configuration (V transposed in the generate models only: the prompt's V re-laid out at
the switch, in place, through a temporary) and the tokens, which must not change.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from conftest import RecordingRequest, own_copies

from npuw_kv.config import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import ModelLayoutError
from npuw_kv.kv.cache import KVSpec, SharedKVCache
from npuw_kv.kv.copy import CopyCounter, copy_by_dim, relayout
from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.model import value_layout as VL
from npuw_kv.model.layout import KVLayout, KVPort
from npuw_kv.model.source import read_ir, resolve_model
from npuw_kv.model.variants import Ladder, prepare, static_ladder
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime import build
from npuw_kv.runtime.compile import check_value_layouts
from npuw_kv.runtime.shapes import shapes_for
from npuw_kv.runtime.static.binding import BoundPort, KVBinding
from npuw_kv.runtime.static.prefix_store import HostPrefixCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.npu_path  # also run under the NPU rules double

C = 16
NPU = {"NPUW_ONLINE_PIPELINE": "NONE", **EXACT_F32}  # as test_npu_variants.py: tiny graphs


def _ids(n: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + seed * 13) % 49000 + 100


# -- the graph rewrite ---------------------------------------------------------------------
def test_rewrite_gives_every_model_a_heads_dim_seq_v(smol_dir):
    """SmolLM2 (GQA 9:3, f16 KV): every layer's past V is [1, H, D, S], its Concat runs along
    axis 3, attention multiplies by V with transpose_b, and the present V is [1, H, D, n]."""
    model, layout = prepare(read_ir(ov.Core(), smol_dir), kv_precision="f16")
    shapes = StaticShapes(chunk=64, max_prompt_len=256, total_len=320)
    ladder = static_ladder(model, layout, shapes, VL.ValueLayouts(True, True))
    ((_, prefill),), ((_, generate),) = ladder.prefill, ladder.generate
    for m, past, new in ((prefill, 192, 64), (generate, 319, 1)):
        shape = {i.get_any_name(): i.get_partial_shape() for i in m.inputs}
        assert shape["past_key_values.7.value"] == ov.PartialShape([1, 3, 64, past])
        assert shape["past_key_values.7.key"] == ov.PartialShape([1, 3, past, 64])  # K as it was
        for port in layout.ports:
            present = m.outputs[port.output_index].get_partial_shape()
            expected = [1, 3, 64, new] if port.kind == "value" else [1, 3, new, 64]
            assert present == ov.PartialShape(expected)
        ops_ = list(m.get_ordered_ops())
        assert not any(op.get_type_name() == "ScaledDotProductAttention" for op in ops_)
        by_v = [
            op
            for op in ops_
            if op.get_type_name() == "MatMul"
            and op.get_attributes()["transpose_b"]
            and op.input_value(0).get_node().get_type_name() == "Softmax"
            and op.input_value(1).get_node().get_type_name() == "Convert"
        ]
        joins = [op.input_value(1).get_node().input_value(0).get_node() for op in by_v]
        assert len(joins) == 30  # one per layer: softmax x V^T, V joined in f16, then upcast
        assert all(j.get_type_name() == "Concat" and j.get_axis() == 3 for j in joins)
        assert all(j.get_output_element_type(0) == ov.Type.f16 for j in joins)
    # the prepared model itself is left as it was (the ladder transposes clones)
    shape = {i.get_any_name(): i.get_partial_shape() for i in model.inputs}
    assert shape["past_key_values.0.value"][3].get_length() == 64


def _toy(feeds_attention: bool) -> tuple[ov.Model, KVLayout]:
    """One layer whose V either reaches attention or (unknown pattern) only a Relu."""
    q = ops.parameter([1, 2, 3, 4], np.float32, name="q")
    mask = ops.parameter([1, 1, 3, 8], np.float32, name="mask")
    params, outs = {}, []
    for kind in ("key", "value"):
        past = ops.parameter([1, 2, 5, 4], np.float32, name=f"past_key_values.0.{kind}")
        past.output(0).set_names({f"past_key_values.0.{kind}"})
        new = ops.parameter([1, 2, 3, 4], np.float32, name=f"new_{kind}")
        params[kind] = (past, new, ops.concat([past, new], 2))
    _, new_v, v = params["value"]
    if feeds_attention:
        out = ops.scaled_dot_product_attention(q, params["key"][2], v, mask, causal=False)
    else:
        out = ops.relu(v)
    outs = [ops.result(out), ops.result(params["key"][1]), ops.result(new_v)]
    inputs = [q, mask, *[p for pair in params.values() for p in pair[:2]]]
    model = ov.Model(outs, inputs)
    ports = tuple(
        KVPort(0, kind, f"past_key_values.0.{kind}", i + 1, 2, 4, 2, "f32")
        for i, kind in enumerate(("key", "value"))
    )
    return model, KVLayout(ports, 0, (None,))


def test_rewrite_matches_before_changing_and_refuses_unknown_graphs():
    model, layout = _toy(feeds_attention=False)
    with pytest.raises(VL.ValueLayoutMismatch, match="Relu"):
        VL.transpose_value_tensors(model, layout)
    param = next(p for p in model.get_parameters() if p.get_friendly_name().endswith("value"))
    assert param.get_partial_shape() == ov.PartialShape([1, 2, 5, 4])  # untouched

    model, layout = _toy(feeds_attention=True)
    reference = ov.Core().compile_model(model.clone(), "CPU", EXACT_F32)
    transposed = VL.transpose_value_tensors(model, layout)
    assert [p.seq_axis for p in transposed.ports] == [2, 3] and transposed.values_transposed
    rng = np.random.default_rng(0)
    feeds = {
        i.get_any_name(): rng.normal(0, 1, i.get_shape()).astype(np.float32)
        for i in reference.inputs
    }
    expected = reference(feeds)[0]
    feeds["past_key_values.0.value"] = feeds["past_key_values.0.value"].transpose(0, 1, 3, 2)
    out = ov.Core().compile_model(model, "CPU", EXACT_F32)(feeds)
    np.testing.assert_allclose(out[0], expected, atol=1e-6)
    np.testing.assert_array_equal(out[2], feeds["new_value"].transpose(0, 1, 3, 2))


def test_explicit_yes_on_a_graph_no_phase_matches_is_refused():
    layout = _toy(True)[1]
    ladder = Ladder([], [], layout, layout, {"prefill": "x", "generate": "x"})
    with pytest.raises(ModelLayoutError, match="NPUW_LLM_OPTIMIZE_V_TENSORS"):
        check_value_layouts(PipelineConfig.from_kwargs("NPU", optimize_v_tensors=True), ladder)
    one = Ladder([], [], layout, layout, {"prefill": "x"})
    with pytest.warns(RuntimeWarning, match="prefill models keep V"):
        check_value_layouts(PipelineConfig.from_kwargs("NPU", optimize_v_tensors=True), one)
    # auto (YES on a real NPU): V stays [1, H, S, D] in both phases, with a warning; where one
    # phase had matched, the ladder is built again untransposed (True)
    with pytest.warns(RuntimeWarning, match="NPUW_LLM_OPTIMIZE_V_TENSORS.* auto"):
        assert not check_value_layouts(PipelineConfig.from_kwargs("NPU"), ladder)
    with pytest.warns(RuntimeWarning, match="V stays"):
        assert check_value_layouts(PipelineConfig.from_kwargs("NPU"), one)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matched = Ladder([], [], layout, layout)
        assert not check_value_layouts(PipelineConfig.from_kwargs("NPU"), matched)


def test_auto_builds_the_plain_ladder_where_one_phase_did_not_match(monkeypatch):
    """``auto`` never leaves the mixed layout (a V copy at every switch): the ladder is built
    again with V untransposed in both phases."""
    from npuw_kv.runtime import compile as compile_

    layout = _toy(True)[1]
    asked: list[object] = []

    def static_ladder(model, layout_, shapes, values=None, packed=()):
        asked.append(values)
        return Ladder([], [], layout, layout, {"prefill": "no match"} if values else {})

    monkeypatch.setattr(compile_, "static_ladder", static_ladder)
    # auto, decided as on a real NPU: V transposed
    decided = replace(
        decide.decide(ov.Core(), PipelineConfig.from_kwargs("NPU")), v_transposed=True
    )
    with pytest.warns(RuntimeWarning, match="V stays"):
        ladder = compile_.checked_ladder(None, layout, decided, None)  # type: ignore[arg-type]
    assert asked == [VL.ValueLayouts(True, True), None] and not ladder.mismatched


@pytest.mark.parametrize(
    ("device", "settings", "refused"),
    [
        ("CPU", {"attention_backend": "sdpa"}, True),  # one dynamic model: not these shapes
        ("CPU", {}, True),  # PagedAttention
        ("CPU", {"static_models": True}, False),
        ("NPU", {}, False),
    ],
)
def test_setting_is_refused_where_there_are_no_static_models(device, settings, refused):
    if refused:
        with pytest.raises(ValueError, match="NPUW_LLM_OPTIMIZE_V_TENSORS"):
            PipelineConfig.from_kwargs(device, NPUW_LLM_OPTIMIZE_V_TENSORS="YES", **settings)
    else:
        config = PipelineConfig.from_kwargs(device, NPUW_LLM_OPTIMIZE_V_TENSORS="YES", **settings)
        assert decide.v_transposed(config, "CPU")
    auto = PipelineConfig.from_kwargs(device, **settings)
    # auto: only where NPUW places the static models on a real NPU, one sequence at a time (a
    # packed generate model reads V untransposed: model/packed.py)
    assert not decide.v_transposed(auto, "NPU,CPU")
    assert not decide.v_transposed(auto, "CPU")
    if auto.use_static_models:
        alone = PipelineConfig.from_kwargs(device, max_num_seqs=1, **settings)
        assert decide.v_transposed(alone, "NPU,CPU") and not decide.v_transposed(alone, "CPU")


# -- the buffer, the guard, the copy between layouts ----------------------------------------
def test_contiguous_guard_stages_every_transposed_v_slot_range():
    """One KV head: K's slot ranges are dense, V^T's never are (each of D rows is cut) but the
    whole buffer; the guard binds K directly and stages V."""
    cache = SharedKVCache([KVSpec("k", 1, 4), KVSpec("v", 1, 4, seq_axis=3)], 12, "f32")
    ports = [BoundPort("k", 0), BoundPort("v", 1, seq_axis=3)]
    assert not cache.view("v", 0, 6).is_continuous() and cache.view("k", 0, 6).is_continuous()
    request, counter = RecordingRequest(), CopyCounter()
    binding = KVBinding(
        request,  # type: ignore[arg-type]
        ports,
        cache,
        past_len=6,
        new_tokens=2,
        mode="contiguous",
        counter=counter,
    )
    assert binding.past_paths == {"k": "direct", "v": "staged"}
    assert list(request.inputs["v"].shape) == [1, 1, 4, 6]
    cache.rows("v", 0, 6)[...] = np.arange(24, dtype=np.float32).reshape(1, 1, 4, 6)
    binding.before((6, 8), 6)
    assert binding.output_paths == {"k": "direct", "v": "staged"}
    np.testing.assert_array_equal(request.inputs["v"].data, cache.rows("v", 0, 6))
    assert counter.bytes == 6 * 4 * 4  # V's past rows synced: 6 slots x D 4 x f32
    written = np.arange(8, dtype=np.float32).reshape(1, 1, 4, 2) + 100
    request.outputs[1].data[...] = written  # what the device writes: [1, H, D, 2]
    binding.after((6, 8))
    np.testing.assert_array_equal(cache.buffers["v"][:, :, :, 6:8], written)
    assert counter.bytes == 6 * 4 * 4 + 2 * 4 * 4
    assert (binding.outputs_direct, binding.outputs_staged) == (1, 1)
    whole = KVBinding(
        RecordingRequest(),  # type: ignore[arg-type]
        ports,
        cache,
        past_len=12,
        new_tokens=1,
        mode="contiguous",
        counter=counter,
    )
    assert whole.past_paths == {"k": "direct", "v": "direct"}  # the generate past: in place


def test_in_place_relayout_needs_its_temporary():
    """The first n slots of one V buffer, written as [H, n, D] (a model that keeps V as it is)
    and re-laid out as [H, D, n] at the same base pointer: the source and destination overlap,
    and a copy that does not handle overlap (column by column) corrupts them."""
    heads, dim, n, capacity = 3, 8, 10, 16
    cache = SharedKVCache([KVSpec("v", heads, dim, seq_axis=3)], capacity, "f32")
    source, target = cache.rows("v", 0, n, 2), cache.rows("v", 0, n, 3)
    assert source.ctypes.data == target.ctypes.data == cache.buffers["v"].ctypes.data
    assert np.shares_memory(source, target)
    tokens = np.random.default_rng(0).normal(0, 1, (1, heads, n, dim)).astype(np.float32)

    def written() -> np.ndarray:
        cache.buffers["v"][...] = np.nan
        cache.rows("v", 0, n, 2)[...] = tokens
        return cache.rows("v", 0, n, 2)

    copy_by_dim(target, written(), 3, 2)  # no temporary
    assert not np.array_equal(target, tokens.transpose(0, 1, 3, 2))

    counter = CopyCounter()
    relayout(target, written(), 3, 2, counter)
    np.testing.assert_array_equal(target, tokens.transpose(0, 1, 3, 2))
    assert counter.bytes == heads * dim * n * 4 and counter.copies == 1

    cache.content_axis["v"] = 2  # what the runner records after a prefill of that layout
    written()
    assert cache.relayout("v", 0, n, 3) == heads * dim * n * 4
    np.testing.assert_array_equal(cache.rows("v", 0, n), tokens.transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(cache.token_rows("v", 0, n), tokens[0])
    assert cache.relayout("v", 0, n, 2) == heads * dim * n * 4  # and back, for a continuation
    np.testing.assert_array_equal(cache.rows("v", 0, n, 2), tokens)


def test_prefix_store_round_trips_transposed_v():
    heads, dim = 2, 8
    ports = tuple(
        KVPort(0, kind, f"past_key_values.0.{kind}", i + 1, heads, dim, 2 + i, "f32")
        for i, kind in enumerate(("key", "value"))
    )
    layout = KVLayout(ports, 0, (None,))
    specs = [KVSpec(p.input_name, heads, dim, p.seq_axis) for p in ports]
    cache = SharedKVCache(specs, 128, "f32")
    rng = np.random.default_rng(1)
    for buf in cache.buffers.values():
        buf[...] = rng.normal(0, 1, buf.shape)
    v = "past_key_values.0.value"
    saved = cache.buffers[v][:, :, :, 5:69].copy()
    store = HostPrefixCache(cache, layout, 64, CopyCounter())
    tokens = list(range(100, 164))
    store.save(tokens, first_slot=5)
    cache.buffers[v][...] = 0
    prompt = np.array([*tokens, 1], np.int64)
    store.restore(prompt, store.lookup(prompt), first_slot=30)
    np.testing.assert_array_equal(cache.buffers[v][:, :, :, 30:94], saved)
    assert not cache.buffers[v][:, :, :, :30].any()


# -- the pipeline, NPU path (NPUW on CPU) -----------------------------------------------------
def test_transposed_v_gives_the_same_tokens_and_copies_nothing(tiny_dir, tiny_reference):
    """Prompts crossing several pyramid prefill variants, answers crossing a generate variant:
    V transposed gives the reference's tokens and logits, with 0 bytes copied."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=1536, min_response_len=16, **NPU)
    settings["prefill_attention"] = "pyramid"  # the full ladder: many variants to cross
    plain = LLMPipeline(tiny_dir, "NPU", optimize_v_tensors="NO", **settings)
    pipe = LLMPipeline(tiny_dir, "NPU", NPUW_LLM_OPTIMIZE_V_TENSORS="YES", **settings)
    stats = pipe.kv_stats()
    assert (stats["v_layout"], stats["prefill_v_layout"]) == ("HDS", "HDS")
    assert plain.kv_stats()["v_layout"] == "HSD"
    assert stats["generate_variants"] == [1040, 1551]  # whole chunks: a block edge
    runner = pipe.runner
    port = next(p for p in runner.layout.ports if p.kind == "value")
    # the buffer in blocks where the models' pasts end, each a dense [1, H, D, rows]
    blocks = runner.cache.blocks[port.input_name]
    edges = [first for first, _ in blocks[1:]]
    assert edges == list(runner.cache.edges) and 1040 in edges
    assert all(b.shape == (1, 2, 16, b.shape[3]) for _, b in blocks)
    assert sum(b.shape[3] for _, b in blocks) == 1551  # [1, H, D, capacity] in all
    first = runner.requests.prefill.get_tensor(port.input_name)  # the past's first block
    assert first.is_continuous() and list(first.shape) == [1, 2, 16, edges[0]]
    assert first.data.ctypes.data == blocks[0][1].ctypes.data  # the block itself, not a copy

    for ids, new in ((_ids(1020, seed=3), 24), (_ids(90), 8)):
        expected = plain.generate(ids, max_new_tokens=new, ignore_eos=True)
        result = pipe.generate(ids, max_new_tokens=new, ignore_eos=True)
        assert result.tokens == expected.tokens == tiny_reference(ids, new)
        assert len(set(result.tokens)) > 2
        np.testing.assert_allclose(result.first_logits, expected.first_logits, atol=1e-4)
        stats = pipe.kv_stats()
        assert own_copies(stats) == 0 and stats["switch_host_bytes_copied"] == 0
        if len(ids) == 1020:  # 64 chunks on 10 prefill models; steps cross 1040 mid-answer
            assert len(set(stats["prefill_pasts_used"])) == 8  # pasts 0, 16, .., 1024
            assert stats["generate_past_used"] == 1551


def test_real_npu_defaults_f16_kv_with_transposed_v(tiny_dir):
    """What ``auto`` picks on a real NPU, f16 KV with V transposed (runtime/device.py,
    config.v_transposed), over the lean ladders: the tokens of one f16 model per phase with V as
    it is, logits within f16 rounding, and still 0 bytes copied."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=512, min_response_len=16, **NPU)
    settings["kv_precision"] = "f16"
    plain = LLMPipeline(
        tiny_dir,
        "NPU",
        optimize_v_tensors="NO",
        prefill_attention="static",
        generate_pyramid="NO",
        **settings,
    )
    pipe = LLMPipeline(tiny_dir, "NPU", optimize_v_tensors="YES", **settings)
    stats = pipe.kv_stats()
    assert (stats["v_layout"], stats["kv_precision"]) == ("HDS", "f16")
    assert stats["prefill_variants"] == [144, 320, 496]  # lean: two rungs and the whole
    for ids, new in ((_ids(500, seed=5), 16), (_ids(40), 8)):
        expected = plain.generate(ids, max_new_tokens=new, ignore_eos=True)
        result = pipe.generate(ids, max_new_tokens=new, ignore_eos=True)
        assert result.tokens == expected.tokens and len(set(result.tokens)) > 2
        np.testing.assert_allclose(result.first_logits, expected.first_logits, atol=1e-3)
        assert own_copies(pipe.kv_stats()) == 0


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_vt")
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    return resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)


def _mixed(model: Path, monkeypatch, settings: dict) -> LLMPipeline:
    """A pipeline whose prefill models 'do not match' the V rewrite (as NPUW meets on some
    models): V transposed in the generate models only, said in a warning."""
    rewrite = VL.transpose_value_tensors

    def prefill_unmatched(model: ov.Model, layout: KVLayout) -> KVLayout:
        if "prefill" in model.get_friendly_name():
            raise VL.ValueLayoutMismatch("test: the prefill pattern")
        return rewrite(model, layout)

    monkeypatch.setattr(VL, "transpose_value_tensors", prefill_unmatched)
    with pytest.warns(RuntimeWarning, match="prefill models keep V as"):
        return LLMPipeline(model, "NPU", optimize_v_tensors="YES", **settings)


@pytest.mark.parametrize("kv_binding", ["roi", "contiguous"])
def test_mixed_layouts_relayout_the_prompt_at_the_switch(tiny_gguf, monkeypatch, kv_binding):
    """The prefill pattern 'does not match' (as NPUW meets on some models): the generate models
    store V transposed, the prefill models do not.  Both still use one buffer; the prompt's V is
    re-laid out in place at the switch (counted), and back for a continuation's kept slots."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=128, min_response_len=32, **NPU)
    settings.update(kv_binding=kv_binding, prefix_reuse=True)
    # both with the KV buffer in one block: the same staging, so the bytes differ by the
    # relayout alone
    monkeypatch.setattr(build, "static_shapes", lambda d, n: shapes_for(d.config, n))
    plain = LLMPipeline(tiny_gguf, "NPU", optimize_v_tensors="NO", **settings)
    mixed = _mixed(tiny_gguf, monkeypatch, settings)
    stats = mixed.kv_stats()
    assert (stats["v_layout"], stats["prefill_v_layout"]) == ("HDS", "HSD")

    ids = _ids(90)  # 6 chunks, 6 pad slots: the prompt's KV in slots [6, 96)
    expected = plain.generate(ids, max_new_tokens=12, ignore_eos=True)
    base = plain.kv_stats()["host_bytes_copied"]  # staging (contiguous), the same in both
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = mixed.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert result.tokens == expected.tokens and len(set(result.tokens)) > 2
    layout = mixed.layout
    v_row = layout.num_kv_heads * layout.head_dim * 4  # one slot of one V buffer, f32
    relaid = 90 * layout.num_layers * v_row
    stats = mixed.kv_stats()
    assert stats["switch_host_bytes_copied"] - plain.kv_stats()["switch_host_bytes_copied"] == (
        relaid
    )
    assert stats["host_bytes_copied"] == base + relaid

    # a chat turn: the kept slots go back to the prefill layout, the new prompt's V forward
    longer = np.concatenate([ids, result.tokens, _ids(5, seed=2)])
    again = mixed.generate(longer, max_new_tokens=6, ignore_eos=True)
    assert mixed.kv_stats()["reused_tokens"] > 0
    assert again.tokens == plain.generate(longer, max_new_tokens=6, ignore_eos=True).tokens


def test_mixed_layouts_over_kv_blocks(tiny_gguf, monkeypatch):
    """V transposed in the generate models only, the buffer in blocks where the pasts end:
    the relayout at the switch goes block by block and the tokens are the plain pipeline's."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=128, min_response_len=32, **NPU)
    plain = LLMPipeline(tiny_gguf, "NPU", optimize_v_tensors="NO", **settings)
    mixed = _mixed(tiny_gguf, monkeypatch, settings)
    assert mixed.runner.cache.edges and mixed.runner.cache.edges == plain.runner.cache.edges
    ids = _ids(90)
    result = mixed.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert result.tokens == plain.generate(ids, max_new_tokens=12, ignore_eos=True).tokens
    assert mixed.kv_stats()["switch_host_bytes_copied"] > 0  # the prompt's V re-laid out
    longer = np.concatenate([ids, result.tokens, _ids(5, seed=2)])
    again = mixed.generate(longer, max_new_tokens=6, ignore_eos=True)
    assert mixed.kv_stats()["reused_tokens"] > 0
    assert again.tokens == plain.generate(longer, max_new_tokens=6, ignore_eos=True).tokens
