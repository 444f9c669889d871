"""A device that refuses strided tensors gets contiguous staging copies instead (no model)."""

from __future__ import annotations

import pytest

from npuw_kv.model.layout import KVLayout, KVPort
from npuw_kv.model.variants import StaticShapes
from npuw_kv.runtime.compile import Requests
from npuw_kv.runtime.static_runner import StaticRunner


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


def layout() -> KVLayout:
    ports = tuple(
        KVPort(0, kind, f"past_key_values.0.{kind}", i + 1, 2, 8, 2, "f32")
        for i, kind in enumerate(("key", "value"))
    )
    return KVLayout(ports, 0, (None,))


def test_refused_roi_views_fall_back_to_copy_binding():
    prefill, generate = StridedRefusingRequest(), StridedRefusingRequest()
    requests = Requests(prefill, generate, shared_weights=False, device_properties={})
    with pytest.warns(RuntimeWarning, match="kv_binding='copy'"):
        runner = StaticRunner(requests, layout(), StaticShapes(4, 8, 12), kv_binding="roi")
    assert runner.kv_binding == "copy"
    past = prefill.inputs["past_key_values.0.key"]
    assert past.is_continuous() and list(past.shape) == [1, 2, 4, 8]  # MAX_PROMPT_LEN - C
    assert list(generate.inputs["past_key_values.0.value"].shape) == [1, 2, 11, 8]
    assert list(prefill.outputs[1].shape) == [1, 2, 4, 8]  # staging for C new rows


def test_copy_binding_never_binds_views():
    prefill, generate = StridedRefusingRequest(), StridedRefusingRequest()
    requests = Requests(prefill, generate, shared_weights=False, device_properties={})
    runner = StaticRunner(requests, layout(), StaticShapes(4, 8, 12), kv_binding="copy")
    assert runner.kv_binding == "copy" and len(prefill.inputs) == 2 and len(generate.outputs) == 2
