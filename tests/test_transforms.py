"""Graph rewrites on the real SmolLM2 IR (the one openvino-genai makes from the GGUF)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import ModelLayoutError
from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.model import attention as A
from npuw_kv.model import transforms as T
from npuw_kv.model.layout import discover_layout
from npuw_kv.model.source import read_ir
from npuw_kv.model.variants import prepare, static_ladder

SHAPES = StaticShapes(chunk=64, max_prompt_len=256, total_len=320)


@pytest.fixture()
def smol_model(smol_dir):
    return read_ir(ov.Core(), smol_dir)


def test_static_reshape_needs_the_gqa_broadcast_fix(smol_model):
    T.make_stateless(smol_model)
    layout = discover_layout(smol_model)
    broken = smol_model.clone()
    with pytest.raises(Exception, match="Broadcast"):
        T.set_shapes(broken, layout, 64, 256, 192)
    # K and V of 30 layers: the literal 0 (sequence) and the length taken from a shape (batch)
    assert A.fix_gqa_broadcast(smol_model) == 120
    T.set_shapes(smol_model, layout, 64, 256, 192)
    assert smol_model.outputs[1].get_partial_shape().is_static


def test_layout_pairs_ports_by_structure_not_names(smol_model):
    T.make_stateless(smol_model)
    layout = discover_layout(smol_model)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert layout.precision == "f32"
    # the converted IR names V outputs "present.{i}.key": names alone would mis-pair them
    value_port = next(p for p in layout.ports if p.kind == "value")
    assert "key" in smol_model.outputs[value_port.output_index].get_any_name()
    assert len({p.output_index for p in layout.ports}) == 60
    for port in layout.ports:
        concat = (
            smol_model.outputs[port.output_index].get_node().input(0).get_source_output().get_node()
        )
        assert port.input_name in concat.input(0).get_source_output().get_names()


def test_static_ladder_of_the_whole_past_has_one_model_per_phase(smol_model):
    model, layout = prepare(smol_model)
    ladder = static_ladder(model, layout, SHAPES)  # no pyramid, no generate variants
    ((_, prefill),), ((_, generate),) = ladder.prefill, ladder.generate
    shape = {i.get_any_name(): i.get_shape() for i in prefill.inputs}
    assert shape["input_ids"] == [1, 64] and shape["attention_mask"] == [1, 256]
    assert shape["past_key_values.0.key"] == [1, 3, 192, 64]
    assert prefill.outputs[layout.logits_output_index].get_shape() == [1, 1, 49152]
    assert prefill.outputs[layout.ports[0].output_index].get_shape() == [1, 3, 64, 64]
    gshape = {i.get_any_name(): i.get_shape() for i in generate.inputs}
    assert gshape["input_ids"] == [1, 1] and gshape["attention_mask"] == [1, 320]
    assert gshape["past_key_values.29.value"] == [1, 3, 319, 64]
    assert generate.outputs[layout.ports[-1].output_index].get_shape() == [1, 3, 1, 64]


def test_kv_precision_f16(smol_model):
    model, layout = prepare(smol_model, kv_precision="f16")
    assert layout.precision == "f16"
    params = {p.get_friendly_name(): p for p in model.get_parameters()}
    assert params["past_key_values.3.value"].get_element_type() == ov.Type.f16
    assert model.outputs[layout.ports[7].output_index].get_element_type() == ov.Type.f16


def test_f16_kv_is_joined_before_the_upcast(smol_dir, monkeypatch):
    """Each f16 past meets the chunk's new KV in an f16 Concat, upcast once after it (no f32
    copy of the past alone), and the logits and new KV are those of upcasting the past first."""
    core = ov.Core()
    model, layout = prepare(read_ir(core, smol_dir), kv_precision="f16")
    for port in layout.ports:
        param = T._param(model, port.input_name)
        readers = [i.get_node() for i in param.output(0).get_target_inputs()]
        joins = [n for n in readers if n.get_type_name() != "ShapeOf"]
        assert [n.get_type_name() for n in joins] == ["Concat"], port.input_name
        assert joins[0].get_output_element_type(0) == ov.Type.f16
        after = [i.get_node() for i in joins[0].output(0).get_target_inputs()]
        assert [n.get_type_name() for n in after] == ["Convert"]
        assert after[0].get_output_element_type(0) == ov.Type.f32

    monkeypatch.setattr(T, "_join_stored", lambda *args: None)
    upcast_first, _ = prepare(read_ir(core, smol_dir), kv_precision="f16")
    assert (
        sum(
            op.get_type_name() == "Concat" and op.get_output_element_type(0) == ov.Type.f16
            for op in upcast_first.get_ops()
        )
        == 0
    )
    rng = np.random.default_rng(3)
    feed = {
        "input_ids": np.array([[42, 7, 901, 13]], np.int64),
        "position_ids": np.arange(10, 14, dtype=np.int64)[None],
        "attention_mask": np.ones((1, 14), np.int64),
        "beam_idx": np.zeros(1, np.int32),
    }
    for port in layout.ports:
        feed[port.input_name] = rng.normal(0, 1, (1, 3, 10, 64)).astype(np.float16)
    outputs = []
    for m in (model, upcast_first):
        request = core.compile_model(m, "CPU", dict(EXACT_F32)).create_infer_request()
        names = {i.get_any_name() for i in m.inputs}
        request.infer({k: v for k, v in feed.items() if k in names})
        outputs.append([request.get_output_tensor(i).data.copy() for i in range(len(m.outputs))])
    for joined, first in zip(*outputs, strict=True):
        np.testing.assert_array_equal(joined, first)
    assert np.abs(outputs[0][layout.logits_output_index]).max() > 1.0


def test_non_llm_graphs_are_rejected():
    x = ops.parameter([1, 4], np.float32, name="x")
    plain = ov.Model([ops.relu(x)], [x])
    with pytest.raises(ModelLayoutError, match="input_ids"):
        T.make_stateless(plain)
    ids = ops.parameter([1, -1], np.int64, name="input_ids")
    mask = ops.parameter([1, -1], np.int64, name="attention_mask")
    pos = ops.parameter([1, -1], np.int64, name="position_ids")
    for p, n in ((ids, "input_ids"), (mask, "attention_mask"), (pos, "position_ids")):
        p.output(0).set_names({n})
    no_kv = ov.Model([ops.add(ops.add(ids, mask), pos)], [ids, mask, pos])
    with pytest.raises(ModelLayoutError, match="not a decoder LLM"):
        T.make_stateless(no_kv)


def _count(model: ov.Model, kind: str) -> int:
    return sum(op.get_type_name() == kind for op in model.get_ops())


@pytest.mark.parametrize("cuts", [(6,), (3, 6)])
def test_split_past_reads_past_then_tails(smol_model, cuts):
    """``Concat(past, past.tail, ...)`` gives the same logits as one past input holding all the
    parts (two parts: the CPU's sliced past; more: a static model over several KV blocks)."""
    model, layout = prepare(smol_model, kv_precision="f16")  # a Convert sits after each past
    T.set_shapes(model, layout, None, None, None)
    plain = model.clone()
    concats = _count(model, "Concat")
    parts_count = len(cuts) + 1
    assert T.split_past(model, layout, parts_count) == 60
    assert _count(model, "Concat") == concats  # the tails join the new-KV Concat, no extra copy
    names = {i.get_any_name() for i in model.inputs}
    assert len(names) == 3 + 60 * parts_count
    assert {T.tail_input(p.input_name, len(cuts)) for p in layout.ports} <= names

    core, rng = ov.Core(), np.random.default_rng(0)
    past = {p.input_name: rng.normal(0, 1, (1, 3, 10, 64)).astype(np.float16) for p in layout.ports}
    step = {
        "input_ids": np.array([[42]], np.int64),
        "position_ids": np.array([[10]], np.int64),
        "attention_mask": np.ones((1, 11), np.int64),
    }
    exact = dict(EXACT_F32)
    whole = core.compile_model(plain, "CPU", exact).create_infer_request()
    whole.infer({**step, **past})
    split = core.compile_model(model, "CPU", exact).create_infer_request()
    parts = {}
    bounds = (0, *cuts, 10)
    for name, value in past.items():
        for part, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            parts[T.tail_input(name, part)] = value[:, :, a:b].copy()
    split.infer({**step, **parts})
    index = layout.logits_output_index
    expected = whole.get_output_tensor(index).data
    np.testing.assert_allclose(split.get_output_tensor(index).data, expected, atol=1e-5)
    assert np.abs(expected).max() > 1.0  # real logits, not an all-zero output


def test_softmax_scale_moves_to_the_query(smol_model):
    """SDPA gets scale 1 and a pre-scaled query; head_dim 64 (scale 1/8) keeps logits bit-equal."""
    T.make_stateless(smol_model)
    A.fix_gqa_broadcast(smol_model)
    layout = discover_layout(smol_model)
    A.fold_gqa_into_attention(smol_model)
    T.set_shapes(smol_model, layout, None, None, None)
    unscaled = smol_model.clone()
    assert A.scale_query_for_attention(smol_model) == 30
    for sdpa in (
        op for op in smol_model.get_ops() if op.get_type_name() == "ScaledDotProductAttention"
    ):
        scale = sdpa.input(4).get_source_output().get_node()
        while scale.get_type_name() == "Convert":
            scale = scale.input(0).get_source_output().get_node()
        assert scale.get_type_name() == "Constant" and scale.get_data().item() == 1.0
        query = sdpa.input(0).get_source_output().get_node()
        assert query.get_type_name() == "Multiply"

    core, rng = ov.Core(), np.random.default_rng(1)
    feeds = {
        "input_ids": rng.integers(0, 49152, (1, 5)).astype(np.int64),
        "position_ids": np.arange(12, 17, dtype=np.int64)[None],
        "attention_mask": np.ones((1, 17), np.int64),
    }
    feeds |= {
        p.input_name: rng.normal(0, 1, (1, 3, 12, 64)).astype(np.float32) for p in layout.ports
    }
    logits = []
    for model in (unscaled, smol_model):
        request = core.compile_model(model, "CPU", dict(EXACT_F32)).create_infer_request()
        request.infer(feeds)
        logits.append(request.get_output_tensor(layout.logits_output_index).data.copy())
    assert np.abs(logits[0]).max() > 1.0
    np.testing.assert_array_equal(logits[1], logits[0])


def test_slice_past_reads_only_what_the_mask_covers(smol_model):
    """Past bound to a whole 20-slot buffer, mask over 12 past slots: the logits of binding
    just those 12 slots.  The tail is never sliced (the generate step reads all of it)."""
    model, layout = prepare(smol_model)
    T.set_shapes(model, layout, None, None, None)
    T.split_past(model, layout)
    unsliced = model.clone()
    assert T.slice_past(model, layout) == 60

    core, rng = ov.Core(), np.random.default_rng(2)
    buffers = {
        p.input_name: rng.normal(0, 1, (1, 3, 20, 64)).astype(np.float32) for p in layout.ports
    }
    empty = np.zeros((1, 3, 0, 64), np.float32)
    new = {
        "input_ids": rng.integers(0, 49152, (1, 5)).astype(np.int64),
        "position_ids": np.arange(12, 17, dtype=np.int64)[None],
        "attention_mask": np.ones((1, 17), np.int64),
    }
    exact = dict(EXACT_F32)
    sliced = core.compile_model(model, "CPU", exact).create_infer_request()
    plain = core.compile_model(unsliced, "CPU", exact).create_infer_request()
    index = layout.logits_output_index
    cases = [  # (past, tail) bound to the sliced model, then to the plain one
        ({n: b for n, b in buffers.items()}, {n: empty for n in buffers}),
        ({n: b[:, :, :12].copy() for n, b in buffers.items()}, {n: empty for n in buffers}),
    ]
    results = []
    for request, (past, tail) in zip((sliced, plain), cases, strict=True):
        feeds = {**new, **past, **{T.tail_input(n): t for n, t in tail.items()}}
        request.infer(feeds)
        results.append(request.get_output_tensor(index).data.copy())
    assert np.abs(results[1]).max() > 1.0
    np.testing.assert_array_equal(results[0], results[1])
    step = {
        "input_ids": np.array([[42]], np.int64),
        "position_ids": np.array([[20]], np.int64),
        "attention_mask": np.ones((1, 21), np.int64),
    }
    generate = {**step, **{n: empty for n in buffers}}
    generate |= {T.tail_input(n): b for n, b in buffers.items()}
    outputs = []
    for request in (sliced, plain):
        request.infer(generate)
        outputs.append(request.get_output_tensor(index).data.copy())
    np.testing.assert_array_equal(outputs[0], outputs[1])
