"""The static models of one phase, each bound to the shared KV cache, and which one runs.

A phase has a ladder of static models by past length (``model/variants.py``); every one reads
the view ``[0, past)`` of the same buffers (:class:`~npuw_kv.runtime.static.binding.KVBinding`), so
moving between them copies nothing.  A chunk or a step runs on the smallest that holds every
slot before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import openvino as ov

from ...kv.cache import SharedKVCache
from ...kv.copy import CopyCounter
from ..compile import Variant
from .binding import BoundPort, KVBinding


@dataclass(frozen=True)
class BoundModel:
    """One static model (a variant by past length) with its binding to the shared cache."""

    past: int
    request: ov.InferRequest
    binding: KVBinding


def bind_ladder(
    variants: Sequence[Variant],
    ports: list[BoundPort],
    cache: SharedKVCache,
    new_tokens: int,
    mode: str,
    counter: CopyCounter,
    sliced: bool,
    grow: bool,
    strided_outputs: bool = True,
) -> list[BoundModel]:
    """Bind each variant's past inputs and present outputs to ``cache`` (``mode``: roi,
    contiguous or copy).  ``grow``: the prefill's ladder, whose chunks on a sliced-past model
    read exactly the slots before them (:class:`~npuw_kv.runtime.static.binding.KVBinding`)."""
    return [
        BoundModel(
            v.past,
            v.request,
            KVBinding(
                v.request,
                ports,
                cache,
                past_len=v.past,
                new_tokens=new_tokens,
                mode=mode,
                counter=counter,
                sliced=sliced,
                grow=grow,
                strided_outputs=strided_outputs,
            ),
        )
        for v in variants
    ]


def pick(models: Sequence[BoundModel], slot: int) -> BoundModel:
    """The model with the smallest past that holds every slot before ``slot``."""
    return next(m for m in models if m.past >= slot)
