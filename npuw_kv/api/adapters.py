"""LoRA adapters, shaped like openvino-genai's ``Adapter`` and ``AdapterConfig``.

An :class:`Adapter` reads a PEFT-layout safetensors file into each layer's low-rank pair
(``A``: rank x in, ``B``: out x rank).  An :class:`AdapterConfig` says which adapters apply and
with what alpha; the pipeline registers a config's adapters at construction and a call's config
picks among them (:mod:`npuw_kv.model.lora` puts them into the graph, switched by alpha alone).

As in openvino-genai, a layer's update is ``alpha * B @ A`` with the alpha given here: PEFT's
``lora_alpha / r`` (``adapter_config.json``) is not applied; fold it into the alpha.
"""

from __future__ import annotations

import enum
import math
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..errors import UsageError
from ..model.lora import LoraPair
from ..model.safetensors import read_safetensors

PREFIX = "base_model.model."  # PEFT's wrapper around the model's own names (genai strips it too)
_PART = re.compile(r"^(?P<layer>.+?)[._]lora[._](?P<part>A|B|down|up)(?:\.[\w-]+)?\.weight$")
_ALPHA = re.compile(r"^(?P<layer>.+)\.alpha$")
GENAI_ADAPTER = (
    "adapters: openvino_genai's Adapter does not expose its matrices; build it with "
    "npuw_kv.Adapter(path) (and npuw_kv.AdapterConfig)"
)
F32_MAX = float(np.finfo(np.float32).max)  # an alpha beyond it is inf in the graph


class Adapter:
    """A LoRA adapter read from a safetensors file: its layers' ``A``/``B`` pairs.

    Adapters compare by identity, as genai's: the same file read twice is two adapters."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.layers: dict[str, LoraPair] = _pairs(self.name, read_safetensors(self.path))
        if not self.layers:
            raise UsageError(f"LoRA adapter {self.name!r} holds no lora_A / lora_B matrices")

    @property
    def name(self) -> str:
        return str(self.path)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Adapter({self.name!r}, {len(self.layers)} layers)"


def _pairs(name: str, tensors: dict[str, np.ndarray]) -> dict[str, LoraPair]:
    parts: dict[str, dict[str, np.ndarray]] = {}
    keys: dict[tuple[str, str], str] = {}  # (layer, part) -> the tensor that gave it
    alphas = []
    for key, value in tensors.items():
        short = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        match = _PART.match(short)
        if match is None:
            if _ALPHA.match(short):
                alphas.append(key)
                continue
            raise UsageError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B matrix (full "
                "weights, such as PEFT's modules_to_save, are not supported)"
            )
        part = "A" if match["part"] in ("A", "down") else "B"
        if (match["layer"], part) in keys:
            raise UsageError(
                f"LoRA adapter {name!r} gives layer {match['layer']!r}'s lora_{part} twice: "
                f"{keys[match['layer'], part]!r} and {key!r}"
            )
        keys[match["layer"], part] = key
        parts.setdefault(match["layer"], {})[part] = value
    if alphas:
        warnings.warn(
            f"LoRA adapter {name!r} carries per-layer alpha tensors ({alphas[0]}, ...); as "
            "openvino-genai, npuw-kv scales each update by the AdapterConfig's alpha only",
            RuntimeWarning,
            stacklevel=4,
        )
    out = {}
    for layer, pair in sorted(parts.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            missing = "lora_B" if a is not None else "lora_A"
            raise UsageError(f"LoRA adapter {name!r}, layer {layer!r}: no {missing} matrix")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise UsageError(
                f"LoRA adapter {name!r}, layer {layer!r}: lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} are not a rank x in and an out x rank matrix"
            )
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise UsageError(f"LoRA adapter {name!r}, layer {layer!r}: NaN or infinite values")
        out[layer] = LoraPair(np.ascontiguousarray(a), np.ascontiguousarray(b))
    return out


class AdapterConfig:
    """Which adapters apply, each with its alpha (genai's ``AdapterConfig``).

    ``AdapterConfig()`` applies none (the base model); ``AdapterConfig(adapter)``,
    ``AdapterConfig(adapter, alpha)``, ``AdapterConfig([adapter, ...])`` and
    ``AdapterConfig([(adapter, alpha), ...])`` as in genai (alpha 1 unless given).  ``mode`` is
    accepted for genai's code: npuw-kv always keeps the matrices beside the weights and switches
    adapters by alpha, which gives every mode's tokens without recompiling."""

    class Mode(enum.IntEnum):
        MODE_AUTO = 0
        MODE_DYNAMIC = 1
        MODE_STATIC_RANK = 2
        MODE_STATIC = 3
        MODE_FUSE = 4

    def __init__(self, adapters: Any = None, alpha: Any = None, mode: Any = None) -> None:
        if isinstance(adapters, AdapterConfig.Mode) and alpha is None and mode is None:
            adapters, mode = None, adapters
        if isinstance(alpha, AdapterConfig.Mode) and mode is None:
            alpha, mode = None, alpha
        self.mode = AdapterConfig.Mode(mode if mode is not None else 0)
        self._alphas: dict[Adapter, float] = {}
        if adapters is None:
            if alpha is not None:
                raise UsageError("AdapterConfig: an alpha needs an adapter")
            return
        if isinstance(adapters, (list, tuple)):
            if alpha is not None:
                raise UsageError("AdapterConfig: give a list of (adapter, alpha) pairs instead")
            for item in adapters:
                if isinstance(item, tuple):
                    self.add(*item)
                else:
                    self.add(item)
            return
        self.add(adapters, 1.0 if alpha is None else alpha)

    def add(self, adapter: Adapter, alpha: float = 1.0) -> AdapterConfig:
        """Apply ``adapter`` with ``alpha`` (a finite number)."""
        self._alphas[_adapter(adapter)] = _alpha(adapter, alpha)
        return self

    def set_alpha(self, adapter: Adapter, alpha: float) -> AdapterConfig:
        if adapter not in self._alphas:
            raise UsageError(f"{adapter!r} is not in this AdapterConfig; add() it first")
        self._alphas[adapter] = _alpha(adapter, alpha)
        return self

    def get_alpha(self, adapter: Adapter) -> float:
        if adapter not in self._alphas:
            raise UsageError(f"{adapter!r} is not in this AdapterConfig")
        return self._alphas[adapter]

    def remove(self, adapter: Adapter) -> AdapterConfig:
        self._alphas.pop(adapter, None)
        return self

    def get_adapters(self) -> list[Adapter]:
        return list(self._alphas)

    def get_adapters_and_alphas(self) -> list[tuple[Adapter, float]]:
        return list(self._alphas.items())

    def set_adapters_and_alphas(self, adapters: Iterable[tuple[Adapter, float]]) -> None:
        alphas = {_adapter(a): _alpha(a, alpha) for a, alpha in adapters}
        self._alphas = alphas

    def get_mode(self) -> AdapterConfig.Mode:
        return self.mode

    def set_mode(self, mode: Any) -> None:
        self.mode = AdapterConfig.Mode(mode)

    def __bool__(self) -> bool:
        return bool(self._alphas)

    def __repr__(self) -> str:
        inner = ", ".join(f"({a.name!r}, {alpha})" for a, alpha in self._alphas.items())
        return f"AdapterConfig([{inner}])"


def _adapter(adapter: Any) -> Adapter:
    if isinstance(adapter, Adapter):
        return adapter
    if type(adapter).__name__ == "Adapter" and type(adapter).__module__.startswith(
        "openvino_genai"
    ):
        from .genai_objects import genai_adapter_path, our_adapter

        return cast(Adapter, our_adapter(genai_adapter_path(adapter)))
    raise UsageError(f"expected an npuw_kv.Adapter, got {type(adapter).__name__}")


def _alpha(adapter: Any, alpha: Any) -> float:
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or isinstance(alpha, bool) or abs(value) > F32_MAX:
        name = adapter.name if isinstance(adapter, Adapter) else repr(adapter)
        raise UsageError(
            f"LoRA adapter {name!r}: alpha must be a finite number within float32's range "
            f"(the model reads it as one), got {alpha!r}"
        )
    return value


def adapter_config(value: Any) -> AdapterConfig | None:
    """A call's or the constructor's ``adapters`` value: ours, None, or a clear refusal."""
    if value is None or isinstance(value, AdapterConfig):
        return value
    if isinstance(value, Adapter):
        return AdapterConfig(value)
    if type(value).__module__.startswith("openvino_genai"):
        if type(value).__name__ == "AdapterConfig":
            from .genai_objects import genai_adapter_paths, our_adapter

            # genai's config: the adapters read again from their files, with its alphas
            pairs = [(our_adapter(p), alpha) for p, alpha in genai_adapter_paths(value)]
            out = AdapterConfig()
            out.set_adapters_and_alphas(pairs)
            return out
        if type(value).__name__ == "Adapter":
            return AdapterConfig(_adapter(value))
        raise UsageError(GENAI_ADAPTER)
    raise UsageError(f"adapters: expected an npuw_kv.AdapterConfig, got {type(value).__name__}")
