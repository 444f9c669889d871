"""Which LoRA adapters apply: the alpha input every compiled request reads.

The graph holds each registered adapter's matrices (:mod:`npuw_kv.model.lora`); a call picks
adapters and alphas by writing one small input.  The KV the model computed under other alphas
is not what it computes now, so a switch drops the runner's cached prefixes
(:meth:`~npuw_kv.runtime.runner.Runner.forget_prefixes`): a prompt is never continued from KV of
another adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov

from ..errors import UsageError
from ..model.lora import ALPHA_INPUT, LoraGraph

if TYPE_CHECKING:
    from ..api.adapters import AdapterConfig

Alphas = tuple[float, ...]


class LoraSwitch:
    """The alpha input of every request that has it, and the alphas it holds now."""

    def __init__(
        self, graph: LoraGraph, requests: Sequence[ov.InferRequest], initial: AdapterConfig
    ) -> None:
        self.graph = graph
        self.initial = initial  # what a call without ``adapters`` applies (genai's default)
        self._requests = [
            r
            for r in requests
            if any(ALPHA_INPUT in i.get_names() for i in r.get_compiled_model().inputs)
        ]
        if not self._requests:
            raise AssertionError("no compiled model reads the LoRA alpha input")
        self.current: Alphas = ()
        self.set(self.alphas(initial))

    def alphas(self, config: AdapterConfig | None) -> Alphas:
        """The alpha of every registered adapter under ``config`` (None: the constructor's);
        an adapter that was not registered at construction is refused."""
        chosen = self.initial if config is None else config
        given: dict[object, float] = dict(chosen.get_adapters_and_alphas())
        unknown = [a for a in given if a not in self.graph.adapters]
        if unknown:
            name = getattr(unknown[0], "name", unknown[0])
            raise UsageError(
                f"LoRA adapter {name!r} was not registered at construction: pass "
                "every adapter a call may use in LLMPipeline(..., adapters=AdapterConfig(...))"
            )
        return tuple(float(given.get(a, 0.0)) for a in self.graph.adapters)

    def set(self, alphas: Alphas) -> bool:
        """Bind ``alphas`` to every request; whether they differ from the last ones."""
        if alphas == self.current:
            return False
        tensor = ov.Tensor(np.array(alphas, np.float32))
        for request in self._requests:
            request.set_tensor(ALPHA_INPUT, tensor)
        self.current = alphas
        return True


def no_adapters(config: AdapterConfig | None) -> None:
    """A pipeline built without adapters: a call may ask for none (or an empty config)."""
    if config:
        raise UsageError(
            "this pipeline was built without LoRA adapters: register them at construction, "
            "LLMPipeline(..., adapters=AdapterConfig(...))"
        )
