"""An NPU's I/O rules (runtime/npu_rules.py), their double on NPUW's CPU stand-in
(runtime/npu_double.py), and the NPU path meeting them: strided outputs staged (or, refused at
the first infer, staged from then on), no zero-size inputs, NPU copies estimated as the double
counts them, a missing NPU compiler as one error after one compile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from conftest import TINY_CHUNK, TINY_NPU

from npuw_kv.errors import CompileError
from npuw_kv.kv.memory import PAGE, aligned_zeros
from npuw_kv.model.empty_inputs import drop_empty_inputs
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.npu_compile import missing_npu
from npuw_kv.runtime.npu_double import DeviceCopies, NpuRulesRequest
from npuw_kv.runtime.npu_rules import (
    STRIDED_REFUSED,
    DeviceMemory,
    copied_bytes,
    input_copied,
    output_copied,
    page_aligned,
)

C, NPU = TINY_CHUNK, TINY_NPU


def _ids(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 240, n).astype(np.int64)


def _roi(tensor: ov.Tensor, start: int, stop: int) -> ov.Tensor:
    end = list(tensor.get_shape())
    end[2] = stop
    return ov.Tensor(tensor, ov.Coordinate([0, 0, start, 0]), ov.Coordinate(end))


# -- the rules on tensors alone --------------------------------------------------------------
@pytest.mark.unit
def test_device_memory_holds_its_own_arrays_and_their_views_only():
    memory, host = DeviceMemory(device=True), DeviceMemory()
    array = memory.zeros(2 * 8 * 4, np.dtype(np.float16)).reshape(1, 2, 8, 4)
    assert array.ctypes.data % PAGE == 0 and not array.any()
    whole = ov.Tensor(array, shared_memory=True)
    strided, dense = _roi(whole, 2, 5), _roi(whole, 0, 8)
    assert memory.holds(whole) and memory.holds(strided) and not strided.is_continuous()
    assert not memory.holds(ov.Tensor(np.zeros((1, 2, 8, 4), np.float16)))
    # NPUW's input rule: contiguous device memory is read in place, anything else copied
    assert not input_copied(whole, memory) and not input_copied(dense, memory)
    assert input_copied(strided, memory)
    assert input_copied(whole, host) and not host.holds(whole)  # host memory: always copied
    assert copied_bytes([(whole, False), (strided, False)], [], memory) == strided.byte_size
    assert not input_copied(strided, memory, strided=True)  # NPU_ENABLE_STRIDES_FOR names it


@pytest.mark.unit
def test_host_outputs_are_imported_only_page_aligned():
    memory = DeviceMemory()
    aligned = ov.Tensor(aligned_zeros(PAGE // 4, np.dtype(np.float32)), shared_memory=True)
    assert page_aligned(aligned) and not output_copied(aligned, memory)
    ragged = ov.Tensor(aligned_zeros(PAGE // 4 + 1, np.dtype(np.float32))[1:], shared_memory=True)
    assert not page_aligned(ragged) and output_copied(ragged, memory)
    short = ov.Tensor(aligned_zeros(10, np.dtype(np.float32)), shared_memory=True)
    assert output_copied(short, memory)  # the address is aligned, the size is not


@pytest.mark.unit
@pytest.mark.parametrize(
    ("message", "piece"),
    [
        ('Cannot load library "libopenvino_intel_npu_compiler_loader.so"', "NPU compiler"),
        ("Could not find an NPU device. The driver compiler requires", "an NPU device"),
        ("No available backend", "NPU driver"),
        ("remote_context.cpp:17: Level zero backend is not found!", "NPU driver"),
    ],
)
def test_a_missing_npu_piece_is_named(message, piece):
    error = missing_npu(RuntimeError(message))
    assert isinstance(error, CompileError)
    assert piece in str(error) and "npuw_devices='CPU'" in str(error)


@pytest.mark.unit
def test_other_compile_failures_are_not_a_missing_piece():
    assert missing_npu(RuntimeError("unordered_map::at")) is None


def _concat_model() -> ov.Model:
    past = ops.parameter([1, 2, 0, 4], np.float32, name="past")
    past.output(0).set_names({"past"})
    new = ops.parameter([1, 2, 3, 4], np.float32, name="new")
    new.output(0).set_names({"new"})
    joined = ops.concat([ops.convert(past, np.float32), new], 2)
    length = ops.gather(ops.shape_of(past), ops.constant(np.int64(2)), ops.constant(np.int64(0)))
    total = ops.add(ops.convert(length, np.float32), joined)
    return ov.Model([total], [past, new])


@pytest.mark.unit
def test_empty_inputs_are_taken_out_and_other_uses_refused():
    model = _concat_model()
    assert drop_empty_inputs(model) == ("past",)
    assert [p.get_any_name() for p in model.inputs] == ["new"]
    assert drop_empty_inputs(model) == ()  # nothing left to take out
    odd = ops.parameter([1, 0], np.float32, name="odd")
    bad = ov.Model([ops.relu(odd)], [odd])
    with pytest.raises(Exception, match="feeds a Relu"):
        drop_empty_inputs(bad)
    assert len(bad.inputs) == 1  # refused before anything changed


def test_empty_inputs_taken_out_compute_the_same():
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    core = ov.Core()
    before = core.compile_model(_concat_model(), "CPU")
    want = before({"past": np.zeros((1, 2, 0, 4), np.float32), "new": x})[0]
    model = _concat_model()
    drop_empty_inputs(model)
    np.testing.assert_array_equal(core.compile_model(model, "CPU")({"new": x})[0], want)


# -- the double on a compiled request ----------------------------------------------------------
def _request() -> ov.InferRequest:
    x = ops.parameter([1, 2, 4, 4], np.float32, name="x")
    x.output(0).set_names({"x"})
    y = ops.relu(x)
    y.output(0).set_names({"y"})
    return ov.Core().compile_model(ov.Model([y], [x]), "CPU").create_infer_request()


def test_double_refuses_a_strided_output_at_infer_not_at_bind():
    memory, copies = DeviceMemory(device=True), DeviceCopies()
    request = NpuRulesRequest(_request(), memory, copies)
    array = memory.zeros(2 * 8 * 4, np.dtype(np.float32)).reshape(1, 2, 8, 4)
    buffer = ov.Tensor(array, shared_memory=True)
    request.set_tensor("x", ov.Tensor(np.ones((1, 2, 4, 4), np.float32)))
    request.set_output_tensor(0, _roi(buffer, 2, 6))  # accepted here, as NPUW stores it
    with pytest.raises(RuntimeError, match=STRIDED_REFUSED):
        request.infer()
    assert copies.calls == 0
    allowed = NpuRulesRequest(request.request, memory, copies, frozenset({"y"}))
    allowed.infer()  # strides enabled for the port: written in place
    assert (buffer.data[0, :, 2:6] == 1).all() and (buffer.data[0, :, :2] == 0).all()
    # the host input was copied (numpy memory), the device output was not
    assert (copies.calls, copies.bytes, copies.tensors) == (1, 2 * 4 * 4 * 4, 1)


def test_double_refuses_zero_size_inputs():
    x = ops.parameter([1, 0], np.float32, name="x")
    model = ov.Model([ops.concat([x, ops.constant(np.ones((1, 2), np.float32))], 1)], [x])
    compiled = ov.Core().compile_model(model, "CPU")
    request = NpuRulesRequest(compiled.create_infer_request(), DeviceMemory(), DeviceCopies())
    request.set_tensor(compiled.inputs[0], ov.Tensor(np.zeros((1, 0), np.float32)))
    with pytest.raises(RuntimeError, match="zero size"):
        request.infer()


# -- the NPU path under the double -------------------------------------------------------------
@pytest.mark.parametrize("kv_binding", ["roi", "contiguous", "copy"])
def test_every_binding_meets_the_npu_rules(tiny_dir, tiny_reference, kv_binding):
    """Pyramid prefill and a generate variant, a prompt over several chunks then a longer one
    that continues it (prefix reuse): the reference's tokens, nothing refused, and the
    runner's estimate of the NPU's copies is what the double counted."""
    settings = dict(NPU, kv_binding=kv_binding, prefill_attention="pyramid")
    pipe = LLMPipeline(tiny_dir, "NPU", npu_io_double=True, **settings)
    stats = pipe.kv_stats()
    assert (stats["npu_io"], stats["npu_kv_memory"]) == ("double", "device")
    assert stats["prefill_variants"][0] == 0
    for request in pipe.runner.requests.prefill_ladder:  # the model of no past has no past
        shapes = [list(i.get_shape()) for i in request.request.get_compiled_model().inputs]
        assert all(0 not in shape for shape in shapes)
    first = _ids(3 * C - 5)
    for ids in (first, np.concatenate([first, _ids(C, seed=2)])):
        result = pipe.generate(ids, max_new_tokens=10, ignore_eos=True)
        assert result.tokens == tiny_reference(ids, 10) and len(set(result.tokens)) > 2
        stats = pipe.kv_stats()
        assert stats["double_copied_bytes"] == stats["npu_copied_bytes_estimate"] > 0
        assert "strided_output_refused" not in stats and stats["strided_outputs"] == "staged"
    assert stats["reused_tokens"] > 0
    # under the double the strided outputs are staged; the stand-in without it binds them
    plain = LLMPipeline(tiny_dir, "NPU", **settings)
    assert plain.kv_stats()["strided_outputs"] == "direct"
    assert plain.kv_stats()["npu_io"] == "none (CPU stand-in)"


def test_a_strided_output_refused_at_the_first_infer_is_staged_from_then_on(
    tiny_dir, tiny_reference
):
    """Strides said to be enabled for a port that is not there: the binding binds strided
    views, the device refuses one at infer; one warning, the call rerun, the tokens right."""
    pipe = LLMPipeline(
        tiny_dir, "NPU", npu_io_double=True, NPU_ENABLE_STRIDES_FOR="no.such.port", **NPU
    )
    assert pipe.kv_stats()["strided_outputs"] == "direct"
    ids = _ids(2 * C + 3)
    with pytest.warns(RuntimeWarning, match="refused a strided KV output view at infer") as seen:
        result = pipe.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert len([w for w in seen if "refused a strided" in str(w.message)]) == 1
    assert result.tokens == tiny_reference(ids, 8)
    stats = pipe.kv_stats()
    assert (
        stats["strided_outputs"] == "staged" and STRIDED_REFUSED in stats["strided_output_refused"]
    )
    again = pipe.generate(ids, max_new_tokens=8, ignore_eos=True)  # no second warning
    assert again.tokens == result.tokens


def test_a_missing_npu_compiler_is_one_error_after_one_compile(tiny_dir, monkeypatch):
    """This machine's openvino wheel: the NPU plugin without its compiler library."""
    libs = Path(ov.__file__).parent / "libs"
    has_compiler = (libs / "libopenvino_intel_npu_compiler_loader.so").exists()
    if "NPU" in ov.Core().available_devices:
        pytest.fail("an NPU is present: this test checks the wheel without an NPU compiler")
    calls: list[str] = []
    compile_model = ov.Core.compile_model

    def counted(self, model, device=None, *args, **kwargs):
        calls.append(str(device))
        return compile_model(self, model, device, *args, **kwargs)

    monkeypatch.setattr(ov.Core, "compile_model", counted)
    for devices in ("NPU,CPU", "NPU"):
        calls.clear()
        if has_compiler:  # an archive install: the compiler is there, the device is not
            with pytest.raises(CompileError) as error:
                LLMPipeline(tiny_dir, "NPU", npuw_devices=devices, **NPU)
            assert "NPU compiler" not in str(error.value)
            continue
        with pytest.raises(CompileError, match="the NPU compiler .* is missing") as error:
            LLMPipeline(tiny_dir, "NPU", npuw_devices=devices, **NPU)
        assert "could not fold" not in str(error.value)
        assert calls == ["NPU"], devices  # one compile, for the NPU alone


def test_inspect_says_where_the_sub_models_run_and_how_the_rules_apply(smol_dir):
    from npuw_kv.cli.describe import describe

    out = describe(str(smol_dir), "NPU")
    assert "sub-models       CPU: every sub-model on the CPU (NPUW without an NPU" in out
    assert "NPU I/O          rules enforced by none (CPU stand-in); strided outputs bound" in out
    planned = describe(str(smol_dir), "NPU", npuw_devices="NPU,CPU", npu_io_double=True)
    assert "sub-models       NPU alone first; only where it refuses a sub-model, NPU,CPU" in planned
    assert "enforced by double; strided outputs staged; KV in the device's memory" in planned
    assert "sub-models" not in describe(str(smol_dir), "CPU")
