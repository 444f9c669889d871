"""The prefill body cut at its attention ops (model/layer_split.py).

That the chain of segments and attention models gives the static path's logits is checked by
running scripts/attention_split_probe.py --check (tests/test_scripts.py); here: the cut itself.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from npuw_kv.errors import ModelLayoutError
from npuw_kv.model.layer_split import split_layers
from npuw_kv.model.split import split_model
from npuw_kv.model.variants import StaticShapes, prepare, read_ir, static_pair


def _body(smol_dir: Path):
    shapes = StaticShapes(128, 512, 512 + 127)
    model, layout = prepare(read_ir(ov.Core(), smol_dir), "f16", shapes=shapes)
    body, _ = static_pair(split_model(model, layout).body, layout, shapes)
    return body, layout


@pytest.fixture(scope="module")
def body_and_layout(smol_dir: Path):
    return _body(smol_dir)


def test_middle_layers_share_one_graph_with_their_own_weights(body_and_layout) -> None:
    body, layout = body_and_layout
    split = split_layers(body, layout)
    assert split.layers == 30
    assert sorted(split.middle.weights) == list(range(1, 30))
    # per layer: one tensor per weight input of the shared graph, viewing that layer's
    # constants (no copy), and no two layers viewing the same memory
    inputs = len(split.middle.model.inputs)
    first_weight = len(split.wiring[1])
    for tensors in split.middle.weights.values():
        assert len(tensors) == inputs - first_weight
    starts = {t.data.ctypes.data for tensors in split.middle.weights.values() for t in tensors}
    assert len(starts) == 29 * (inputs - first_weight)
    # the query and the new K, V of each layer leave its segment; K/V in the cache precision
    for segment in (split.first.model, split.middle.model):
        outputs = segment.outputs
        assert [d.get_length() for d in outputs[0].get_partial_shape()] == split.query_shape
        assert [o.get_element_type() for o in outputs[1:3]] == [ov.Type.f16, ov.Type.f16]
        assert all(o.get_partial_shape()[2].get_length() == 128 for o in outputs[1:3])
    # a chain: each middle segment reads the previous layer's attention and, besides segment
    # 0's outputs (RoPE), only the segment just before it
    for k in range(2, 30):
        assert split.wiring[k][0] == ("attention", k - 1)
        assert all(s[1] in (0, k - 1) for s in split.wiring[k] if s[0] == "segment")
    assert ("attention", 29) in split.wiring[30]


def test_attention_model_reads_exactly_the_past_given(body_and_layout) -> None:
    body, layout = body_and_layout
    split = split_layers(body, layout)
    attention = split.attention(256, 128, layout.num_kv_heads, layout.head_dim)
    shapes = [list(i.get_partial_shape().to_shape()) for i in attention.inputs]
    assert shapes[1] == shapes[2] == [1, layout.num_kv_heads, 256 + 128, layout.head_dim]
    assert shapes[3] == [1, 1, split.query_shape[2], 256 + 128]
    assert not any(
        n.get_type_name() == "Constant"
        and n.get_output_size()
        and np.prod(n.get_output_shape(0)) > 1
        for n in attention.get_ordered_ops()
    )


def test_sliding_window_layers_are_refused(body_and_layout) -> None:
    body, layout = body_and_layout
    windowed = replace(layout, window=(64,) + layout.window[1:])
    with pytest.raises(ModelLayoutError, match="sliding-window"):
        split_layers(body, windowed)
