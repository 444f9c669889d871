"""A device that refuses strided tensors gets only contiguous ones: the strided views are
staged through dense copies, the contiguous ones still bound in place (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import openvino as ov
import pytest

from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.model.layout import KVLayout, KVPort
from npuw_kv.runtime.compile import Requests
from npuw_kv.runtime.static.runner import StaticRunner


class StridedRefusingRequest:
    """Stands in for an infer request of a device without ROI support."""

    def __init__(self) -> None:
        self.inputs: dict = {}
        self.outputs: dict = {}

    def _check(self, tensor) -> None:
        if not tensor.is_continuous():
            raise RuntimeError("strided tensors are not supported by this device")

    def set_tensor(self, name, tensor) -> None:
        self._check(tensor)
        self.inputs[name] = tensor

    def set_output_tensor(self, index, tensor) -> None:
        self._check(tensor)
        self.outputs[index] = tensor

    def infer(self) -> None:
        pass

    def get_output_tensor(self, index):
        return ov.Tensor(np.zeros((1, 1, 16), np.float32))  # logits of a vocabulary of 16

    def get_compiled_model(self):
        return SimpleNamespace(inputs=[], outputs=[])  # a model of no ports worth inspecting


def layout() -> KVLayout:
    ports = tuple(
        KVPort(0, kind, f"past_key_values.0.{kind}", i + 1, 2, 8, 2, "f32")
        for i, kind in enumerate(("key", "value"))
    )
    return KVLayout(ports, 0, (None,))


def test_refused_roi_views_fall_back_to_contiguous_binding():
    prefill, generate = StridedRefusingRequest(), StridedRefusingRequest()
    requests = Requests(
        prefill=prefill, generate=generate, shared_weights=False, device_properties={}
    )
    with pytest.warns(RuntimeWarning, match="kv_binding='contiguous'"):
        runner = StaticRunner(requests, layout(), StaticShapes(4, 8, 12), kv_binding="roi")
    assert runner.kv_binding == "contiguous"
    # 2 KV heads: the prefill past [0, MAX_PROMPT_LEN - C) is strided, so it is staged ...
    past = prefill.inputs["past_key_values.0.key"]
    assert past.is_continuous() and list(past.shape) == [1, 2, 4, 8]
    assert set(runner.prefill_binding.past_paths.values()) == {"staged"}
    # ... while the generate past is the whole buffer, bound in place
    whole = generate.inputs["past_key_values.0.value"]
    assert list(whole.shape) == [1, 2, 11, 8]
    assert whole.data.ctypes.data == runner.cache.buffers["past_key_values.0.value"].ctypes.data
    assert set(runner.generate_binding.past_paths.values()) == {"direct"}
    # the strided output views are refused by the device: they go through staging
    runner.prefill(np.arange(5, dtype=np.int64))  # the fake request computes nothing
    assert list(prefill.outputs[1].shape) == [1, 2, 4, 8]  # staging for C new rows
    # 5 tokens: chunks [0, 4), [4, 8); rows staged: past [0, 4) before chunk 1, 8 output rows
    assert runner.host_bytes_copied == (4 + 8) * 2 * (2 * 8 * 4)  # x 2 buffers x (H x D x f32)
    assert runner.prefill_binding.output_paths == {
        "past_key_values.0.key": "staged",
        "past_key_values.0.value": "staged",
    }


def test_copy_binding_never_binds_views():
    prefill, generate = StridedRefusingRequest(), StridedRefusingRequest()
    requests = Requests(
        prefill=prefill, generate=generate, shared_weights=False, device_properties={}
    )
    runner = StaticRunner(requests, layout(), StaticShapes(4, 8, 12), kv_binding="copy")
    assert runner.kv_binding == "copy" and len(prefill.inputs) == 2 and len(generate.outputs) == 2
