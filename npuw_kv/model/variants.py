"""Turn a stateful LLM IR into the prefill / generate models the runtime compiles.

``prepare`` applies the shape-independent rewrites once; ``static_ladder`` clones the result into
the two static shapes (what NPUW compiles), ``shared_dynamic`` leaves the sequence dims open
so one compiled model (one copy of the weights) can run both shapes on a dynamic device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import openvino as ov

from ..errors import ModelLayoutError
from ..kv.shapes import StaticShapes
from . import attention as A
from . import transforms as T
from .empty_inputs import drop_empty_inputs
from .layout import KVLayout, discover_layout
from .packed import every_row_hidden, pack_slots, reshape_packed
from .ring import give_rings
from .value_layout import ValueLayouts, phase_bases
from .window import apply_windows


def prepare(
    model: ov.Model,
    kv_precision: str = "f32",
    full_logits: bool = False,
    declared_window: int | None = None,
    shapes: StaticShapes | None = None,
) -> tuple[ov.Model, KVLayout]:
    """Stateless, GQA-broadcast fix, new-KV-only presents, last-position logits, KV dtype.

    Attention is rewritten so the plugin neither expands nor rescales the past (GQA folded,
    softmax scale moved to the query).

    ``full_logits`` keeps the LM head on every position (C x vocab per chunk): only for
    measuring prompt perplexity, never for serving.  ``declared_window``: the sliding window
    the model's config names, if it is shorter than the KV capacity
    (``families.declared_window``); a model whose graph has no window mask this rewrite knows is
    then refused.  ``shapes``: the static shapes, which say whether sliding-window layers keep
    their KV in rings (``model/ring.py``).
    """
    T.make_stateless(model)
    A.fix_gqa_broadcast(model)
    layout = apply_windows(model, discover_layout(model), declared_window)
    if shapes is not None:
        layout = give_rings(model, layout, shapes.rings(layout.window))
    T.redirect_present_to_new_kv(model, layout)
    if not full_logits:
        T.logits_for_last_position(model, layout)
    A.let_every_row_attend(model)  # a boolean mask must not leave a padded row empty
    A.fold_gqa_into_attention(model)
    A.scale_query_for_attention(model)
    if kv_precision != "f32":
        T.set_kv_precision(model, layout, kv_precision)
        layout = layout.with_precision(kv_precision)
    return model, layout


@dataclass
class Ladder:
    """The static models of both phases, ``(past, model)`` ascending by past (the last of each
    reads the whole past), and each phase's KV layout (V transposed or not)."""

    prefill: list[tuple[int, ov.Model]]
    generate: list[tuple[int, ov.Model]]
    prefill_layout: KVLayout
    generate_layout: KVLayout
    # phases where V transposed was asked for but the graph did not match: why
    mismatched: dict[str, str] = field(default_factory=dict)
    # phases whose smaller variants did not reshape, so only the whole-past model is kept: why
    dropped: dict[str, str] = field(default_factory=dict)
    # packed generate models (model/packed.py): (sequences at once, model), ascending
    packed: list[tuple[int, ov.Model]] = field(default_factory=list)


def static_ladder(
    model: ov.Model,
    layout: KVLayout,
    shapes: StaticShapes,
    values: ValueLayouts | None = None,
    packed: tuple[int, ...] = (),
) -> Ladder:
    """Clone into every prefill ``[1, C]`` and generate ``[1, 1]`` model of ``shapes``, V
    stored transposed in the phases ``values`` asks for (``value_layout.py``).

    A phase whose smaller variant does not reshape keeps its whole-past model alone (the plain
    path; ``Ladder.dropped`` says why, for the caller to refuse or warn by the setting); a
    whole-past model that does not reshape is an error.  The blocks stay those of ``shapes``:
    a whole-past model reads its past as those blocks either way."""
    bases, mismatched = phase_bases(model, layout, values or ValueLayouts())
    models: dict[str, list[tuple[int, ov.Model]]] = {"prefill": [], "generate": []}
    dropped: dict[str, str] = {}
    steps = {
        "prefill": (shapes.chunk, shapes.prefill_pasts),
        "generate": (1, shapes.generate_pasts),
    }
    for phase, (tokens, pasts) in steps.items():
        base, base_layout = bases[phase]
        for past in pasts:
            whole = past == pasts[-1]
            if phase in dropped and not whole:
                continue
            try:
                m = base.clone()
                blocks = shapes.past_blocks(past)  # a past over several blocks: one input each
                if len(blocks) > 1:
                    T.split_past(m, base_layout, len(blocks))
                T.set_shapes(m, base_layout, tokens, past + tokens, past, blocks)
                if past == 0:  # no past at all: no [1, H, 0, D] inputs (an NPU refuses them)
                    drop_empty_inputs(m)
            except Exception as exc:
                if whole:
                    raise ModelLayoutError(f"static reshape failed: {exc}") from exc
                dropped[phase] = f"the {phase} model of past {past} did not reshape ({exc})"
                models[phase] = []
                continue
            m.set_friendly_name(f"npuw_kv_{phase}_past{past}")
            models[phase].append((past, m))
    base, base_layout = bases["generate"]
    packed_models = []
    try:
        packed_models = [(n, packed_model(base, base_layout, shapes, n)) for n in packed]
    except ModelLayoutError as exc:  # the caller refuses or warns, by the setting
        dropped["packed"] = f"the packed generate models did not build ({exc})"
    return Ladder(
        models["prefill"],
        models["generate"],
        bases["prefill"][1],
        base_layout,
        mismatched,
        dropped,
        packed_models,
    )


def packed_model(base: ov.Model, layout: KVLayout, shapes: StaticShapes, slots: int) -> ov.Model:
    """The generate model over the whole past stepping ``slots`` sequences at once."""
    past = shapes.generate_past
    blocks = shapes.past_blocks(past)
    m = base.clone()
    if len(blocks) > 1:
        T.split_past(m, layout, len(blocks))
    T.set_shapes(m, layout, slots, past + slots, past, blocks)
    pack_slots(m, layout, slots)
    every_row_hidden(m, layout)
    reshape_packed(m, layout, slots, blocks if len(blocks) > 1 else (), past)
    m.set_friendly_name(f"npuw_kv_generate_packed{slots}")
    return m


def shared_dynamic(model: ov.Model, layout: KVLayout) -> ov.Model:
    """Batch 1, sequence dims dynamic: serves both static shapes from one compiled model.

    Its past inputs are split in two (:func:`~npuw_kv.model.transforms.split_past`) and the
    first part is sliced to the length the mask gives
    (:func:`~npuw_kv.model.transforms.slice_past`): each request binds the whole shared
    buffer to one part, and a prefill chunk attends only over the slots before it.
    """
    T.set_shapes(model, layout, None, None, None)
    T.split_past(model, layout)
    T.slice_past(model, layout)
    model.set_friendly_name("npuw_kv_shared")
    return model
