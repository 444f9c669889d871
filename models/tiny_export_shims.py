"""Make optimum-intel 2.2 export LFM2, Qwen3.5 (text) and Gemma 2 under transformers 5.5.

Why: optimum-intel 2.2 caps these archs' export configs at the transformers versions it was
checked with (5.0 / 5.4 / 5.2), and its LFM2 and Qwen3.5 patchers import hybrid-cache classes
transformers 5.5 removed; two position fixes keep ``paged_attention_transformation`` right.
``export_patches(arch)`` applies all of it for one export and puts everything back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tiny_common import require as _require

# arch -> the optimum-intel 2.2 export config whose transformers version cap its export lifts.
# Gemma's configs (Gemma 2 inherits it) are capped at 5.0, LFM2's at 5.4, Qwen3.5's at 5.2:
# the versions they were checked with. These tiny models export right beyond them
# (tests/test_families.py checks each export's tokens against the torch model's).
UNCAPPED = {
    "gemma2": "GemmaOpenVINOConfig",
    "lfm2": "LFM2OpenVINOConfig",
    "qwen3_5_text": "Qwen3_5TextOpenVINOConfig",
}


class _HybridCache52:
    """What optimum-intel 2.2's LFM2 / Qwen3.5 patchers need of transformers 5.2's hybrid caches.

    Their patchers subclass ``Lfm2HybridConvCache`` / ``Qwen3_5DynamicCache``, which
    transformers 5.5 removed (its ``DynamicCache`` holds the conv and recurrent states now), so
    the export failed importing them. The subclasses bring their own tensor lists, ``update``
    and ``get_seq_length``; from the base they read the layer bookkeeping set here, and the
    5.5 model code asks it for ``get_mask_sizes(query_length, layer_idx)`` (5.2 took a
    ``cache_position`` tensor) and ``is_compileable``.
    """

    is_compileable = False

    def __init__(self, config: Any, max_batch_size: int | None = None, **_: Any) -> None:
        kinds = list(config.layer_types)
        self.layer_types = kinds
        self.max_batch_size = max_batch_size
        self.transformer_layers = [i for i, k in enumerate(kinds) if k == "full_attention"]
        self.first_attention_layer = self.transformer_layers[0]
        linear = [i for i, k in enumerate(kinds) if k != "full_attention"]
        self.last_linear_layer = linear[-1] if linear else None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # optimum's Qwen3.5 subclass declares has_previous_state as a property (5.2's form);
        # the 5.5 model calls it, has_previous_state(layer_idx=None): made a method here
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("has_previous_state")
        if isinstance(declared, property) and declared.fget is not None:
            getter = declared.fget
            cls.has_previous_state = lambda self, layer_idx=None: getter(self)  # type: ignore

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        raise NotImplementedError("optimum-intel's cache subclass gives the length")

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[Any, int]:
        return query_length + self.get_seq_length(), 0

    def __len__(self) -> int:
        return len(self.layer_types)


# arch -> (transformers module, name) of the 5.2 cache its optimum-intel patcher imports
SHIMMED = {
    "lfm2": ("transformers.models.lfm2.modeling_lfm2", "Lfm2HybridConvCache"),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5DynamicCache"),
}


def _positions_52(forward: Any) -> Any:
    """``Lfm2Model.forward`` numbering the tokens as transformers 5.2 did when not given positions.

    5.5 numbers them ``arange(n) + past``, 5.2 ``arange(past, past + n)``. The export has no
    ``position_ids`` input, so RoPE takes its positions from that expression, and OpenVINO's
    paged_attention_transformation rewrites only 5.2's form: from 5.5's, every token of a
    paged prefill got the last position (the stateful model was right either way).
    """
    torch = _require("torch")

    def forward_52(self: Any, input_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        tokens: Any = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if kwargs.get("position_ids") is None and cache is not None and not args:
            past = cache.get_seq_length()
            kwargs["position_ids"] = torch.arange(past, past + tokens.shape[1]).unsqueeze(0)
        return forward(self, input_ids, *args, **kwargs)

    return forward_52


def _passing_positions(init: Any) -> Any:
    """``Qwen3_5ModelPatcher.__init__`` whose traced forward hands ``position_ids`` to the model.

    optimum-intel 2.2's text-only Qwen3.5 patcher takes ``position_ids`` as an input and drops
    it (its VLM path, how released Qwen3.5 checkpoints export, passes it on); the model then
    numbers tokens from the KV length, which paged_attention_transformation turns into "the
    last position" for every token of a paged prefill (the stateful model was right).
    """

    def init_passing(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        outer, model_forward, given = self.patched_forward, self.model_orig_forward, {}

        def patched_forward(
            input_ids: Any = None,
            attention_mask: Any = None,
            cache_params: Any = None,
            inputs_embeds: Any = None,
            position_ids: Any = None,
        ) -> Any:
            given["position_ids"] = position_ids
            return outer(input_ids, attention_mask, cache_params, inputs_embeds, position_ids)

        def forward_with_positions(*a: Any, **kw: Any) -> Any:
            kw.setdefault("position_ids", given.get("position_ids"))
            return model_forward(*a, **kw)

        self.patched_forward = self.orig_forward = patched_forward
        self.model_orig_forward = forward_with_positions

    return init_passing


@contextmanager
def export_patches(arch: str) -> Iterator[None]:
    """Lift ``arch``'s version cap and supply what it needs of transformers 5.2, for one export."""
    configs = _require("optimum.exporters.openvino.model_configs")
    capped = getattr(configs, UNCAPPED[arch]) if arch in UNCAPPED else None
    cap = capped.MAX_TRANSFORMERS_VERSION if capped is not None else None
    module, name = SHIMMED.get(arch, (None, ""))
    target = _require(module) if module is not None else None
    if target is not None and hasattr(target, name):
        target = None  # a transformers that still has the 5.2 cache needs no shim
    # (class, attribute, replacement) put back afterwards
    swaps: list[tuple[Any, str, Any]] = []
    if arch == "lfm2" and target is not None:
        swaps.append((target.Lfm2Model, "forward", _positions_52(target.Lfm2Model.forward)))
    if arch == "qwen3_5_text":
        patcher = _require("optimum.exporters.openvino.model_patcher").Qwen3_5ModelPatcher
        swaps.append((patcher, "__init__", _passing_positions(patcher.__init__)))
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in swaps]
    if capped is not None:
        capped.MAX_TRANSFORMERS_VERSION = None
    if target is not None:
        setattr(target, name, type(name, (_HybridCache52,), {"__module__": __name__}))
    for owner, attr, replacement in swaps:
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        if capped is not None:
            capped.MAX_TRANSFORMERS_VERSION = cap
        if target is not None:
            delattr(target, name)
        for owner, attr, original in saved:
            setattr(owner, attr, original)
