"""Each call of a static model, as an NPU sees it: what it would copy, and what it refuses.

A real NPU refuses a strided output only when NPUW hands it to the NPU sub-request, inside
``infer()`` (:mod:`npuw_kv.runtime.npu_rules`), so the bind-time fallback of the runner never
sees it.  :class:`NpuCalls` runs each call; on that refusal it has every binding stage its
strided outputs from then on, says so once, and runs the call again (the outputs it rebinds are
the slots the failed call would have written, which no input of that call reads).  On the NPU
path it also adds up, call by call, the bytes an NPU copies by the plugin's rules: an estimate,
kept apart from npuw-kv's own host copies.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import openvino as ov

from ...errors import last_line
from ..device import NpuIO
from ..npu_rules import copied_bytes, strided_output_refused
from .ladder import BoundModel


class NpuCalls:
    """Runs the static models' calls for one runner (its bound models, both phases)."""

    def __init__(self, io: NpuIO | None, models: Sequence[BoundModel]) -> None:
        self.io = io
        self.models = list(models)
        self.estimate = 0  # bytes an NPU would copy, since the last reset (a new prompt)
        self.refused: str | None = None  # the first refusal of a strided output, if any
        self._ports: dict[int, tuple[list[ov.Output], list[ov.Output]]] = {}

    def reset(self) -> None:
        """A new prompt: the estimate, and the double's own count, start again."""
        self.estimate = 0
        if self.io is not None and self.io.double is not None:
            self.io.double.reset()

    def infer(self, model: BoundModel, write_slots: tuple[int, int]) -> None:
        """Run ``model``'s request; a strided output refused is staged and the call rerun."""
        request = model.request
        if self.io is not None:
            self.estimate += self._copied(request)
        try:
            request.infer()
        except RuntimeError as exc:
            if not strided_output_refused(exc) or not model.binding.strided_outputs:
                raise
            self._stage_strided_outputs(model, exc)
            model.binding.stage_strided_outputs(write_slots)
            request.infer()

    def _stage_strided_outputs(self, model: BoundModel, exc: RuntimeError) -> None:
        phase = "generate" if model.binding.new_tokens == 1 else "prefill"
        self.refused = f"{phase} model of past {model.past}: {last_line(exc)}"
        warnings.warn(
            f"the device refused a strided KV output view at infer ({self.refused}); every "
            f"static model's strided outputs (kv_binding={model.binding.mode!r}) are staged "
            "through dense tensors from now on, copied into the cache on the host",
            RuntimeWarning,
            stacklevel=4,
        )
        for other in self.models:
            other.binding.strided_outputs = False

    def _copied(self, request: ov.InferRequest) -> int:
        """What an NPU copies around this call of ``request``, by the tensors bound now."""
        assert self.io is not None
        ports = self._ports.get(id(request))
        if ports is None:
            compiled = request.get_compiled_model()
            ports = self._ports[id(request)] = (list(compiled.inputs), list(compiled.outputs))
        inputs, outputs = ports
        strided = self.io.strided_ports
        return copied_bytes(
            ((request.get_tensor(port), bool(port.get_names() & strided)) for port in inputs),
            (request.get_tensor(port) for port in outputs),
            self.io.memory,
        )
