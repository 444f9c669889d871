"""Several sequences on the static-shape path: one runner per sequence slot, and the packed
generate models that step a token of each in one call.

Each slot is a :class:`~.runner.StaticRunner` over its region of one :class:`SlotPool`: its
prompt runs through the prefill models exactly as a lone sequence's does (the requests are
shared; a slot binds its views before it runs: ``StaticRunner.activate``), and a slot decoding
alone runs the single-sequence generate models.  When several decode, one packed model
(:mod:`npuw_kv.model.packed`) of the smallest size that holds the highest slot among them takes
every row: its past inputs are the pool's first K regions, dense, bound once; its present outputs
are dense ``[1, H, K, D]`` tensors whose rows the host writes into each slot's next KV slot (an
NPU refuses strided outputs; these rows are a few KB a layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import openvino as ov

from ...kv.slot_pool import SlotPool
from ...model.layout import KVLayout
from ...model.packed import packed_mask_input
from ...model.split import EMBEDS_INPUT
from ...model.transforms import tail_input
from ..compile import PackedVariant, Requests
from .rings import window_mask
from .runner import StaticRunner


def _inputs(request: ov.InferRequest) -> dict[str, ov.Output]:
    return {n: i for i in request.get_compiled_model().inputs for n in i.get_names()}


class PackedModel:
    """One packed generate model bound to the pool's first ``slots`` regions."""

    def __init__(
        self, variant: PackedVariant, pool: SlotPool, first: StaticRunner, layout: KVLayout
    ) -> None:
        self.slots, self.request, self.head = variant.slots, variant.request, variant.head
        inputs = _inputs(self.request)
        cache = first.cache
        for name, blocks in cache.blocks.items():
            for part, (_, block) in enumerate(blocks):
                view = pool.packed(cache.specs[name], part, self.slots)
                assert view.size == block.size * self.slots
                self.request.set_tensor(tail_input(name, part), cache.tensor(view))
        # the new rows of every port, [1, H, K, D], dense
        self.present: dict[str, np.ndarray] = {}
        for port in layout.ports:
            rows = cache.zeros(port.input_name, self.slots)
            self.present[port.input_name] = rows
            self.request.set_output_tensor(port.output_index, cache.tensor(rows))
        self.masks = {
            w: inputs[packed_mask_input(w)].get_element_type() == ov.Type.boolean
            for w in set(layout.window)
            if packed_mask_input(w) in inputs
        }
        self.reads_ids = "input_ids" in inputs
        self.logits_index = layout.logits_output_index


class PackedSteps:
    """The packed models over the slots' runners (module docstring)."""

    def __init__(
        self, requests: Requests, lanes: Sequence[StaticRunner], pool: SlotPool, layout: KVLayout
    ) -> None:
        if not requests.packed:
            raise ValueError("no packed generate models to step several sequences with")
        self.requests, self.lanes, self.layout, self.pool = requests, list(lanes), layout, pool
        self.models = [PackedModel(v, pool, self.lanes[0], layout) for v in requests.packed]
        self.past = self.lanes[0].shapes.generate_past
        self.rings = dict(layout.rings)
        self.steps = 0  # packed calls run
        self.rows = 0  # sequence rows they stepped

    def model_for(self, lanes: Sequence[int]) -> PackedModel:
        """The smallest packed model whose regions hold every slot of ``lanes``."""
        top = max(lanes) + 1
        return next(m for m in self.models if m.slots >= top)

    def step(self, tokens: Mapping[int, int]) -> dict[int, np.ndarray]:
        """Feed each slot of ``tokens`` its token, write its KV into the slot's next KV slot, and
        return the next logits of each (rows of the output: valid until the next step)."""
        model = self.model_for(list(tokens))
        k = model.slots
        ids = np.zeros((1, k), np.int64)
        positions = np.zeros((1, k), np.int64)
        masks = {w: np.zeros((1, k, 1, self._keys(w)), bool) for w in model.masks}
        for allowed in masks.values():
            allowed[..., -1] = True  # every row reads its own token at least
        for lane, token in tokens.items():
            slots = self.lanes[lane].slots
            if self.lanes[lane].remaining_capacity <= 0:
                raise RuntimeError(f"slot {lane} has no KV room left for its next token")
            ids[0, lane], positions[0, lane] = token, slots.position
            for window, allowed in masks.items():
                allowed[0, lane, 0] = self._row(window, slots.first, slots.next)
        requests, request = self.requests, model.request
        if requests.embed is not None:
            requests.embed.set_tensor("input_ids", ov.Tensor(ids))
            requests.embed.infer()
            request.set_tensor(EMBEDS_INPUT, requests.embed.get_output_tensor(0))
        if requests.embed is None or model.reads_ids:
            request.set_tensor("input_ids", ov.Tensor(ids))
        request.set_tensor("position_ids", ov.Tensor(positions))
        for window, allowed in masks.items():
            value = allowed if model.masks[window] else np.where(allowed, 0, -np.inf)
            kind = bool if model.masks[window] else np.float16
            request.set_tensor(packed_mask_input(window), ov.Tensor(value.astype(kind)))
        request.infer()
        out = request.get_output_tensor(model.logits_index)
        if model.head is not None:
            model.head.set_input_tensor(out)
            model.head.infer()
            out = model.head.get_output_tensor(0)
        logits = out.data.reshape(k, -1)
        for lane, token in tokens.items():
            runner = self.lanes[lane]
            slot = runner.slots.next
            if runner.slots.keeps_next:
                for name, rows in model.present.items():
                    runner.cache.write(name, slot, slot + 1, rows[:, :, lane : lane + 1], 2)
            runner.wrote(token)
        self.steps += 1
        self.rows += len(tokens)
        return {lane: logits[lane] for lane in tokens}

    def _keys(self, window: int | None) -> int:
        """The keys a row of ``window``'s attentions reads: its layers' past slots, then its own."""
        ring = self.rings.get(window) if window is not None else None
        return (ring or self.past) + 1

    def _row(self, window: int | None, first: int, slot: int) -> np.ndarray:
        """Which keys the row writing token slot ``slot`` reads (slots before ``first`` are
        padding): its past from ``first`` (within the window), and its own token."""
        ring = self.rings.get(window) if window is not None else None
        if ring:
            return window_mask(slot, 1, first, window or 0, ring)[0, 0, 0] == 0
        allowed = np.zeros(self.past + 1, bool)
        start = first if window is None else max(first, slot - window + 1)
        allowed[start:slot] = True
        allowed[-1] = True
        return allowed


def slot_runners(
    make: Callable[[Callable[[str, int, int], np.ndarray] | None, bool], StaticRunner],
    requests: Requests,
    layout: KVLayout,
    precision: str,
) -> tuple[StaticRunner, PackedSteps | None]:
    """The runner of slot 0 (the one a lone call runs on) and the packed steps over every
    slot's runner; without packed models, one runner over its own buffers.  ``make(memory,
    first)``: a runner over the region ``memory`` (``first``: slot 0's)."""
    if not requests.packed:
        return make(None, True), None
    io = requests.npu_io
    pool = SlotPool(
        precision,
        requests.packed[-1].slots,
        **({"allocate": io.memory.zeros} if io is not None else {}),
    )
    lanes = [make(pool.region(slot), slot == 0) for slot in range(pool.slots)]
    lanes[0].activate()
    return lanes[0], PackedSteps(requests, lanes, pool, layout)
