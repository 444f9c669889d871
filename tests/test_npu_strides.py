"""``NPU_ENABLE_STRIDES_FOR`` chosen by npuw-kv (runtime/npu_strides.py): only where the NPU
plugin lists it, naming every KV port; the strided views then bound, and accepted by the NPU
rules double; a compile that fails with it done again without it, once, with a warning; a value
the user gives (``""`` included) used as given."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import openvino as ov
import pytest
from conftest import TINY_CHUNK, TINY_NPU

from npuw_kv.config.decide import Decided, decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.model.source import read_ir
from npuw_kv.model.variants import prepare
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime import npu_strides
from npuw_kv.runtime.device import device_properties
from npuw_kv.runtime.npu_strides import KEY, kv_port_names, strides_supported, with_chosen_strides

C, NPU = TINY_CHUNK, TINY_NPU


class _Core:
    """What the NPU plugin answers for SUPPORTED_PROPERTIES (or its failure to answer)."""

    def __init__(self, supported: list[str] | None) -> None:
        self.supported = supported

    def get_property(self, device: str, name: str) -> Any:
        assert (device, name) == ("NPU", "SUPPORTED_PROPERTIES")
        if self.supported is None:
            raise RuntimeError('Device with "NPU" name is not registered in the OpenVINO Runtime')
        return self.supported


def _decided(device: str = "NPU", **settings: Any) -> Decided[PipelineConfig]:
    config = PipelineConfig.from_kwargs(device, **{**NPU, **settings})
    return decide(ov.Core(), config, False)


def _ids(n: int) -> np.ndarray:
    return np.random.default_rng(1).integers(100, 240, n).astype(np.int64)


@pytest.mark.unit
def test_strides_only_where_the_plugin_lists_the_property():
    assert strides_supported(_Core(["NPU_TURBO", KEY]))  # type: ignore[arg-type]
    assert not strides_supported(_Core(["NPU_TURBO"]))  # type: ignore[arg-type]  # NPU 3720
    assert not strides_supported(_Core(None))  # type: ignore[arg-type]
    assert not strides_supported(ov.Core())  # this machine: no NPU compiler, no listing


@pytest.mark.unit
def test_chosen_only_on_the_npu_path_and_never_over_a_given_value(monkeypatch):
    monkeypatch.setattr(npu_strides, "strides_supported", lambda core: True)
    names = ("past_key_values.0.key", "present.0.key")
    double = _decided(npu_io_double=True)
    chosen = with_chosen_strides(ov.Core(), double, names)
    assert chosen.kv_strides == "past_key_values.0.key,present.0.key"
    assert device_properties(chosen)[1][KEY] == chosen.kv_strides
    assert double.kv_strides == "" and KEY not in device_properties(double)[1]
    for given in ("", "present.0.key"):  # the user's value, "" (none) included, is theirs
        mine = _decided(npu_io_double=True, **{KEY: given})
        assert with_chosen_strides(ov.Core(), mine, names).kv_strides == ""
        assert device_properties(mine)[1].get(KEY) == (given or None)
    cpu = _decided("CPU", attention_backend="sdpa")
    assert with_chosen_strides(ov.Core(), cpu, names).kv_strides == ""
    # NPUW's CPU stand-in without the double: no NPU to take strides
    assert with_chosen_strides(ov.Core(), _decided(), names).kv_strides == ""
    monkeypatch.setattr(npu_strides, "strides_supported", lambda core: False)
    assert with_chosen_strides(ov.Core(), double, names).kv_strides == ""


def test_every_kv_port_is_named(tiny_dir):
    core = ov.Core()
    prepared, layout = prepare(read_ir(core, tiny_dir), "f32", False, None)
    names = set(kv_port_names(prepared, layout))
    for port in layout.ports:  # (a GGUF IR's V outputs may carry their K's tensor name)
        past, present = prepared.input(port.input_name), prepared.outputs[port.output_index]
        assert past.get_names() <= names and present.get_names() <= names
        assert past.get_names() and present.get_names()
    assert not any("," in name for name in names)


def test_chosen_strides_bind_strided_views_the_double_accepts(
    tiny_dir, tiny_reference, monkeypatch
):
    """A driver that takes strides (patched: no NPU here): the strided KV views are bound,
    the double finds every one of their ports named, and NPUW copies less than when staged."""
    ids = _ids(3 * C - 5)
    staged = LLMPipeline(tiny_dir, "NPU", npu_io_double=True, **NPU)
    assert staged.kv_stats()["strided_outputs"] == "staged"
    expected = staged.generate(ids, max_new_tokens=10, ignore_eos=True)
    staged_copies = staged.kv_stats()["npu_copied_bytes_estimate"]

    monkeypatch.setattr(npu_strides, "strides_supported", lambda core: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no refusal, at compile or at infer
        pipe = LLMPipeline(tiny_dir, "NPU", npu_io_double=True, **NPU)
        result = pipe.generate(ids, max_new_tokens=10, ignore_eos=True)
    stats = pipe.kv_stats()
    assert stats["strided_outputs"] == "direct" and "strided_output_refused" not in stats
    assert (stats["kv_strides"], staged.kv_stats()["kv_strides"]) == ("chosen", "none")
    assert result.tokens == expected.tokens == tiny_reference(ids, 10)
    # the pasts are dense blocks in the device's memory either way: the gain is the staging
    assert stats["double_copied_bytes"] == stats["npu_copied_bytes_estimate"] <= staged_copies
    assert stats["staged_output_bytes"] == 0 < staged.kv_stats()["staged_output_bytes"]


def test_a_compile_refusing_the_chosen_strides_is_done_again_without(
    tiny_dir, tiny_reference, monkeypatch
):
    monkeypatch.setattr(npu_strides, "strides_supported", lambda core: True)
    compile_model = ov.Core.compile_model
    seen: list[bool] = []

    def refusing(self, model, device=None, config=None, *args, **kwargs):
        if device == "NPU":
            seen.append(KEY in (config or {}))
            if KEY in (config or {}):
                raise RuntimeError(
                    "Exception from src/vpux_compiler: unknown port in ENABLE_STRIDES_FOR"
                )
        return compile_model(self, model, device, config, *args, **kwargs)

    monkeypatch.setattr(ov.Core, "compile_model", refusing)
    with pytest.warns(RuntimeWarning, match=f"did not compile a model with {KEY}") as caught:
        pipe = LLMPipeline(tiny_dir, "NPU", npu_io_double=True, **NPU)
    assert len([w for w in caught if KEY in str(w.message)]) == 1
    assert seen[0] and not any(seen[1:])  # tried once with it, then without
    assert (pipe.kv_stats()["strided_outputs"], pipe.kv_stats()["kv_strides"]) == ("staged", "none")
    ids = _ids(2 * C + 3)
    assert pipe.generate(ids, max_new_tokens=8, ignore_eos=True).tokens == tiny_reference(ids, 8)


def test_an_empty_value_means_no_strides_and_none_chosen(tiny_dir, monkeypatch):
    monkeypatch.setattr(npu_strides, "strides_supported", lambda core: True)
    compile_model = ov.Core.compile_model
    given: list[dict[str, Any]] = []

    def recorded(self, model, device=None, config=None, *args, **kwargs):
        if device == "NPU":
            given.append(dict(config or {}))
        return compile_model(self, model, device, config, *args, **kwargs)

    monkeypatch.setattr(ov.Core, "compile_model", recorded)
    pipe = LLMPipeline(tiny_dir, "NPU", npu_io_double=True, **{KEY: ""}, **NPU)
    assert given and not any(KEY in props for props in given)  # "" is not passed on
    assert pipe.kv_stats()["strided_outputs"] == "staged"
