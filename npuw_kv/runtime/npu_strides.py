"""``NPU_ENABLE_STRIDES_FOR`` chosen for the KV ports where the NPU's driver and compiler take it.

A real NPU refuses a strided output unless its port was compiled with strides, and NPUW copies a
strided input before every call (:mod:`.npu_rules`).  The present-KV slot views and the past
views inside a block are strided, so without strides the outputs are staged on the host and
those pasts copied by NPUW.  The NPU plugin lists the property among its
``SUPPORTED_PROPERTIES`` only when its compiler knows the option and the driver's graph
extension is 1.16 or later (not on NPU 3720, Meteor and Arrow Lake, whose compiler throws on
it): that listing is the test.

The compiler reads the value as a set of port names and looks a model's inputs and outputs up in
it (``getIoWithDynamicStrides``), so one value naming every KV port of every layer serves each
model, and under ``NPUW_FOLD`` the function bodies too, whose ports are layer 0's.  That reading
could not be checked against a compiler here, so a model whose compile fails with the chosen
value is compiled again without it, after one warning (:class:`StridesChosen`).  A value the
user gives is theirs, used as given (``""``: none, and none chosen).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import openvino as ov

from ..config.decide import Decided, on_real_npu
from ..config.pipeline_config import PipelineConfig
from ..errors import UsageError, last_line
from ..model.layout import KVLayout
from .device import STRIDES as KEY
from .npu_compile import missing_npu

T = TypeVar("T")


def strides_supported(core: ov.Core) -> bool:
    """Whether the NPU plugin says its driver and compiler take ``NPU_ENABLE_STRIDES_FOR``."""
    try:
        supported = core.get_property("NPU", "SUPPORTED_PROPERTIES")
    except RuntimeError:  # no NPU plugin, or one that cannot answer: no strides
        return False
    return KEY in {str(name) for name in supported}


def kv_port_names(model: ov.Model, layout: KVLayout) -> tuple[str, ...]:
    """Every name of every past-KV input and present-KV output of ``model`` (tensor names and
    the nodes' own names: which of them the compiler matches, its source does not say)."""
    names: set[str] = set()
    for port in layout.ports:
        past = model.input(port.input_name)
        present = model.outputs[port.output_index]
        names |= past.get_names() | present.get_names()
        names.add(past.get_node().get_friendly_name())
        names.add(present.get_node().get_friendly_name())
    return tuple(sorted(name for name in names if name and "," not in name))


def with_chosen_strides(
    core: ov.Core, decided: Decided[PipelineConfig], names: tuple[str, ...]
) -> Decided[PipelineConfig]:
    """``decided`` with ``kv_strides`` naming ``names`` when an NPU (or the double of its
    rules) runs the static models, the user set no value, and the NPU takes it."""
    config = decided.config
    if config.device != "NPU" or not decided.static_models or KEY in config.compile_properties:
        return decided
    if not (on_real_npu(decided.npuw_devices) or config.npu_io_double) or not names:
        return decided
    if not strides_supported(core):
        return decided
    return replace(decided, kv_strides=",".join(names))


class StridesChosen:
    """Compiles one pipeline's static models with the strides npuw-kv chose, and without them
    from the first model whose compile fails with them (one warning)."""

    def __init__(self, decided: Decided[PipelineConfig]) -> None:
        self.chosen = bool(decided.kv_strides)
        self.refused: str | None = None

    def compile(self, compile_: Callable[[dict[str, Any]], T], props: dict[str, Any]) -> T:
        """``compile_(props)``; when that fails with the chosen strides in ``props``, they
        leave ``props`` (the caller's dict, so the later models and the requests' record
        lose them too) and the model is compiled again."""
        try:
            return compile_(props)
        except UsageError:
            raise
        except RuntimeError as exc:
            if not self.chosen or KEY not in props or missing_npu(exc) is not None:
                raise
            self.refused = last_line(exc)
        del props[KEY]
        warnings.warn(
            f"the NPU did not compile a model with {KEY} on its KV ports ({self.refused}); "
            "compiling without it: strided KV outputs are staged through dense tensors and "
            f"strided pasts copied by NPUW before each call. Set {KEY}='' to skip this attempt",
            RuntimeWarning,
            stacklevel=4,
        )
        return compile_(props)
