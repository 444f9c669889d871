"""The static-shape runner: chunked prefill and single-token generate over one shared KV cache.

It owns the two infer requests, the cache and the slot bookkeeping; it knows token ids and
logits, not text (that is :mod:`npuw_kv.pipeline`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import openvino as ov

from ...errors import CapacityError
from ...kv.cache import KVSpec, SharedKVCache, layout_name
from ...kv.copy import CopyCounter, safe_copy
from ...kv.memory import aligned_zeros
from ...kv.shapes import StaticShapes
from ...model.layout import KVLayout
from ...model.ring import mask_input
from ...model.split import EMBEDS_INPUT
from ..compile import Requests, Variant
from ..runner import ChunkHook, Runner
from .binding import BoundPort
from .ladder import BoundModel, bind_ladder, pick
from .npu_calls import NpuCalls
from .npu_stats import npu_stats
from .plan import PromptPlan, Slots, StepInputs, chunk_past_len, prefill_inputs
from .prefix_store import HostPrefixCache
from .prompt_reuse import choose_plan, shared_prefix
from .rings import window_mask


def _v_layout(layout: KVLayout) -> str:
    value = next(p for p in layout.ports if p.kind == "value")
    return layout_name(value.seq_axis)


class StaticRunner(Runner):
    """The static prefill and generate requests (and their variants) bound once to ROI views of
    one shared buffer per layer: the prompt runs in chunks, each step writes its token's KV in
    place, and nothing is copied between the phases.  One sequence at a time."""

    cache: SharedKVCache

    def __init__(
        self,
        requests: Requests,
        layout: KVLayout,
        shapes: StaticShapes,
        *,
        kv_binding: str,
        prefix_reuse: bool = True,
        prefix_cache_tokens: int = 0,
        full_rows: bool = False,
        memory: Callable[[str, int, int], np.ndarray] | None = None,
    ) -> None:
        """``prefix_cache_tokens``: room of the host store for earlier prompts' prefixes
        (:mod:`.prefix_store`); 0: only the last sequence is reused.  ``full_rows``: the
        prefill models keep the LM head on every row (``full_prefill_logits``).  ``memory``:
        the KV buffers live in a region of a slot pool (``SharedKVCache``'s ``memory``): one
        of several runners sharing the requests (packed slots, :mod:`.packed`)."""
        self.requests = requests
        self._memory = memory
        self.full_rows = full_rows
        # each phase's KV layout (V transposed or not); the buffers are laid out as the
        # generate models read them, the whole buffer at once
        self.layout = requests.generate_layout or layout
        self.prefill_layout = requests.prefill_layout or layout
        self.shapes = shapes
        self.chunk, self.max_prompt_len = shapes.chunk, shapes.max_prompt_len
        self._specs = [
            KVSpec(p.input_name, p.num_heads, p.head_dim, p.seq_axis, self._ring(p.layer))
            for p in self.layout.ports
        ]
        if self.layout.rings and prefix_cache_tokens:
            raise ValueError(
                "prefix_cache_tokens on the static-shape path stores every layer's whole past; "
                "this model's sliding-window layers keep a ring (window_kv): set "
                "window_kv='full' or prefix_cache_tokens=0"
            )
        self.copied = CopyCounter()
        self.prefill_past = shapes.prefill_past
        # One compiled model serving both shapes (CPU) slices its past by the mask length.  Its
        # prefill must not read a strided view: the CPU plugin stages a strided input through
        # the memory the *other* request bound zero-copy, i.e. our own buffer (an A->A copy
        # that scrambles it).  So both requests bind the whole buffer, which is contiguous.
        self._sliced = requests.shared_weights
        try:
            self._bind(kv_binding)
        except RuntimeError as exc:
            if kv_binding != "roi":
                raise
            # a device that refuses strided (ROI) tensors (an NPU without NPU_ENABLE_STRIDES_FOR)
            # needs dense ones: bind the views that are contiguous (already dense) directly and
            # stage only the strided ones through copies
            warnings.warn(
                f"device refused ROI views of the KV cache ({exc}); using "
                "kv_binding='contiguous' (strided views staged through host copies)",
                RuntimeWarning,
                stacklevel=2,
            )
            kv_binding = "contiguous"
            self._bind(kv_binding)
        self.kv_binding = kv_binding
        self._body_reads_ids = any(
            "input_ids" in i.get_names() for i in requests.prefill.get_compiled_model().inputs
        )
        self.prefill_pasts_used: list[int] = []  # per chunk of the last prompt
        self.prefill_chunk_ms: list[float] = []  # and each chunk's wall time (bench: by past)
        self.generate_past_used = 0  # by the last step
        self.slots = Slots(self.cache.capacity)
        self.switch_copied_bytes = 0
        self.prefill_copied_bytes = 0
        self.prefill_npu_estimate = 0
        self._at_switch = False
        self.prefix_reuse = prefix_reuse
        self._cached: list[int] = []  # token ids whose KV sits in slots [first_slot, ...)
        self.reused_tokens = 0  # of the last prompt, taken from the cache instead of run
        self.prefix_store = (
            HostPrefixCache(self.cache, self.layout, prefix_cache_tokens, self.copied)
            if prefix_cache_tokens
            else None
        )

    def _bind(self, mode: str) -> None:
        shapes = self.shapes
        # TOTAL-1 slots: the generate past input is the whole buffer; the KV of the TOTAL-th
        # token is never read, the last step writes it to scratch.
        requests = self.requests
        edges = () if requests.shared_weights else shapes.block_edges
        io = requests.npu_io
        self.cache = SharedKVCache(
            self._specs,
            shapes.generate_past,
            self.layout.precision,
            edges,
            allocate=io.memory.zeros if io is not None else aligned_zeros,
            memory=self._memory,
        )
        strided_outputs = io is None or io.strided_outputs

        def ports(layout: KVLayout) -> list[BoundPort]:
            return [
                BoundPort(p.input_name, p.output_index, p.seq_axis, self._ring(p.layer))
                for p in layout.ports
            ]

        # every variant reads a view [0, past) of the same buffers: switching copies nothing
        self.prefill_variants = bind_ladder(
            [*requests.prefill_ladder, Variant(self.prefill_past, requests.prefill)],
            ports(self.prefill_layout),
            self.cache,
            shapes.chunk,
            mode,
            self.copied,
            self._sliced,
            grow=True,
            strided_outputs=strided_outputs,
        )
        self.generate_variants = bind_ladder(
            [*requests.generate_ladder, Variant(shapes.generate_past, requests.generate)],
            ports(self.layout),
            self.cache,
            1,
            mode,
            self.copied,
            self._sliced,
            grow=False,
            strided_outputs=strided_outputs,
        )
        self.prefill_binding = self.prefill_variants[-1].binding
        self.generate_binding = self.generate_variants[-1].binding
        self.calls = NpuCalls(requests.npu_io, self.prefill_variants + self.generate_variants)
        requests.bound_to = self

    def activate(self) -> None:
        """Have the requests read this runner's buffers: they are shared with other runners
        (each a sequence's region of a slot pool), and hold whichever bound them last."""
        if self.requests.bound_to is not self:
            for bound in self.prefill_variants + self.generate_variants:
                bound.binding.rebind()
            self.requests.bound_to = self

    def _ring(self, layer: int) -> int:
        """The ring slots of ``layer`` (0: it holds the whole past)."""
        return self.layout.ring_of(layer) or 0

    def forget_prefixes(self) -> None:
        self._cached = []
        if self.prefix_store is not None:
            self.prefix_store.forget()

    # -- state -------------------------------------------------------------------------------
    @property
    def tokens_in_cache(self) -> int:
        # the very last step's KV is discarded, so the count stops at the capacity
        return self.slots.tokens_in_cache

    @property
    def remaining_capacity(self) -> int:
        """How many more tokens can be generated before the KV cache is full."""
        return self.slots.remaining

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is kept for reuse: the last sequence's, in its slots, plus those in
        the prefix store's blocks (the last sequence joins them at the next prompt; the store
        is filled even while ``prefix_reuse`` is off, so turning it on finds them)."""
        stored = self.prefix_store.cached_tokens if self.prefix_store is not None else 0
        return len(self._cached) + stored

    @property
    def shared_weights(self) -> bool:
        return self.requests.shared_weights

    @property
    def host_bytes_copied(self) -> int:
        return self.copied.bytes

    def _infer(
        self, variant: BoundModel, inputs: StepInputs, want_logits: bool = True
    ) -> np.ndarray:
        """Run one step; its logits rows, or none (``[0, 0]``) when ``want_logits`` is False and the
        LM head is cut out (a prefill chunk before the last: its head call would be waste)."""
        request, requests = variant.request, self.requests
        ids = ov.Tensor(inputs.input_ids)
        if requests.embed is not None:  # the embedding runs on its own (model/split.py)
            requests.embed.set_tensor("input_ids", ids)
            requests.embed.infer()
            request.set_tensor(EMBEDS_INPUT, requests.embed.get_output_tensor(0))
        if requests.embed is None or self._body_reads_ids:
            request.set_tensor("input_ids", ids)
        request.set_tensor("position_ids", ov.Tensor(inputs.position_ids))
        request.set_tensor("attention_mask", ov.Tensor(inputs.attention_mask))
        start, stop = inputs.write_slots
        for window, ring in self.layout.rings:
            mask = window_mask(start, stop - start, inputs.first_slot, window, ring)
            request.set_tensor(mask_input(window), ov.Tensor(mask))
        self.calls.infer(variant, inputs.write_slots)
        variant.binding.after(inputs.write_slots)
        out = request.get_output_tensor(self.layout.logits_output_index)
        if requests.head is not None:  # the last position's hidden state -> logits
            if not want_logits:
                return np.empty((0, 0), np.float32)
            requests.head.set_input_tensor(out)
            requests.head.infer()
            out = requests.head.get_output_tensor(0)
        logits = out.data
        return logits.reshape(-1, logits.shape[-1])  # [rows, vocab]: 1 row, or C (full logits)

    def stats(self) -> dict[str, Any]:
        """The common accounting, plus the static models: the past length of each prefill and
        generate variant, and which ones the last prompt's chunks and the last step ran."""
        return {
            **super().stats(),
            "prefill_variants": [v.past for v in self.prefill_variants],
            "generate_variants": [v.past for v in self.generate_variants],
            "prefill_pasts_used": list(self.prefill_pasts_used),
            "prefill_chunk_ms": list(self.prefill_chunk_ms),
            "generate_past_used": self.generate_past_used,
            # V stored [1, H, S, D] ("HSD") or transposed ("HDS"), by the generate models
            # (the buffer) and by the prefill models; they differ only when the V rewrite
            # matched one phase, and the switch then re-lays the prompt's V out
            "v_layout": _v_layout(self.layout),
            # sliding windows whose layers keep their KV in a ring, and its slots
            "window_rings": dict(self.layout.rings),
            "prefill_v_layout": _v_layout(self.prefill_layout),
            **npu_stats(self),
        }

    def _lay_out_v(self, layout: KVLayout, start: int, stop: int) -> int:
        """Have the V slots ``[start, stop)`` laid out as ``layout``'s models read them; the
        bytes copied (none unless the two phases' layouts differ)."""
        copied = 0
        for port in layout.ports:
            if self.cache.content_axis[port.input_name] != port.seq_axis:
                name, axis = port.input_name, port.seq_axis
                # a ring's slots are not in token order: all of it
                span = (0, ring) if (ring := self._ring(port.layer)) else (start, stop)
                copied += self.cache.relayout(name, *span, axis, self.copied)
        return copied

    # -- phases ------------------------------------------------------------------------------
    def prefill(self, ids: np.ndarray, on_chunk: ChunkHook | None = None) -> np.ndarray:
        """Run the chunk loop over ``ids``; return the logits of the last prompt token.

        ``on_chunk(positions, logits)`` is called after each chunk with the prompt positions of
        its real rows and their logits (all rows when the model was prepared with full prefill
        logits, else only the last row) — what prompt perplexity needs; the prompt is then run
        whole, no cached prefix reused.
        """
        *_, logits = self.prefill_chunks(ids, on_chunk)
        assert logits is not None
        return logits

    def prefill_chunks(
        self, ids: np.ndarray, on_chunk: ChunkHook | None = None
    ) -> Iterator[np.ndarray | None]:
        """:meth:`prefill` a chunk at a time: the iterator yields None after each chunk but the
        last, then the last prompt token's logits.  The prompt is checked and planned now;
        other runners sharing the requests (slots of a pool) may run between two chunks."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        self.check_prompt(ids.size)
        self.activate()
        self.copied.reset()
        self.calls.reset()
        if self.prefix_store is not None:  # the last sequence's blocks, before they are overwritten
            self.prefix_store.save(self._cached, self.slots.first)
        plan, restore = (
            choose_plan(
                ids,
                self.shapes.chunk,
                self.shapes.max_prompt_len,
                self._cached,
                self.slots,
                self.layout.rings,
                self.prefix_store,
            )
            if self.prefix_reuse and on_chunk is None  # every row wanted: none from the cache
            else (PromptPlan(int(ids.size), self.shapes.chunk), False)
        )
        # the slots a continuation keeps, in the prefill models' layout (mixed layouts only)
        self._lay_out_v(
            self.prefill_layout, plan.pad, plan.start if plan.cached and not restore else 0
        )
        self._cached = []  # a failure part-way leaves the cache in no state to reuse
        if restore:
            assert self.prefix_store is not None
            self.prefix_store.restore(ids, plan.cached, plan.pad)
        for bound in self.prefill_variants + self.generate_variants:
            bound.binding.reset()
        self.prefill_pasts_used = []
        self.prefill_chunk_ms = []
        return self._chunks(ids, plan, on_chunk)

    def _chunks(
        self, ids: np.ndarray, plan: PromptPlan, on_chunk: ChunkHook | None
    ) -> Iterator[np.ndarray | None]:
        logits = np.empty((1, 0), np.float32)
        last = plan.num_chunks - 1
        for k in range(plan.num_chunks):
            self.activate()  # another slot's runner may have run since the last chunk
            variant = pick(self.prefill_variants, plan.chunk_slots(k)[0])
            binding = variant.binding
            past = chunk_past_len(plan, k, binding.grow, binding.past_len)
            self.prefill_pasts_used.append(past)
            inputs = prefill_inputs(ids, plan, k, past)
            binding.before(inputs.write_slots, inputs.write_slots[0])
            started = time.perf_counter()
            logits = self._infer(variant, inputs, on_chunk is not None or k == last)
            self.prefill_chunk_ms.append((time.perf_counter() - started) * 1e3)
            if on_chunk is not None:
                positions = inputs.position_ids[0, -logits.shape[0] :]
                rows = np.arange(*inputs.write_slots)[-logits.shape[0] :] - plan.pad
                new = rows >= plan.cached  # not padding, and not recomputed cached rows
                on_chunk(positions[new], logits[new])
            if k < last:
                yield None
        self.slots.start(plan)
        self._cached = ids.tolist()
        self.reused_tokens = plan.cached
        self.prefill_copied_bytes = self.copied.bytes
        self.prefill_npu_estimate = self.calls.estimate
        self.switch_copied_bytes = 0
        self._at_switch = True
        yield logits[-1].copy()

    def prefill_every_row(self, ids: np.ndarray, on_rows: ChunkHook) -> np.ndarray:
        """Every prompt row's logits: from the prefill models where they keep the head on
        every row; else the prompt's first token is prefilled and each next one fed as a
        generate step, whose logits are that row's (the same KV and attention, one token at a
        time: slower, nothing more compiled or held)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if self.full_rows:
            return self.prefill(ids, on_rows)
        self.check_prompt(ids.size)
        logits = self.prefill(ids[:1])
        on_rows(np.zeros(1, np.int64), logits[None])
        for position in range(1, ids.size):
            logits = self.step(int(ids[position]))
            on_rows(np.array([position], np.int64), logits[None])
        return logits

    def step(self, token: int) -> np.ndarray:
        """Feed one token, write its KV into the next slot, return the next logits."""
        if self.remaining_capacity <= 0:
            raise CapacityError.cache_full(self.shapes.total_len)
        self.activate()
        kept = self.slots.keeps_next
        variant = pick(self.generate_variants, self.slots.next)
        self.generate_past_used = variant.past
        inputs = self.slots.step_inputs(int(token), variant.past)
        before = self.copied.bytes
        if self._at_switch:  # the prompt's V in the generate models' layout (mixed only)
            self._lay_out_v(self.layout, self.slots.first, self.slots.next)
        variant.binding.before(inputs.write_slots, inputs.write_slots[0])
        if self._at_switch:
            # roi mode: the generate request already reads the buffer prefill wrote (0 bytes);
            # copy mode: this is where the prompt's KV is staged for the generate request.
            self.switch_copied_bytes = self.copied.bytes - before
            self._at_switch = False
        logits = self._infer(variant, inputs)
        if kept:  # the very last step's KV is not kept
            self._cached.append(int(token))
        self.slots.advance()
        return logits[-1].copy()

    def can_truncate(self, length: int) -> bool:
        """A cached prefix of ``length`` tokens (at least one) can be stepped on from, except
        where sliding-window layers keep rings: their slots for earlier tokens are reused."""
        return not self.layout.rings and 0 < length <= len(self._cached)

    def truncate(self, length: int) -> None:
        """Keep the KV of the first ``length`` cached tokens: the next step writes the slot
        after them (a beam that parts from the cached sequence a few tokens back steps on from
        there instead of reading its tail as a prompt)."""
        if not self.can_truncate(length):
            raise ValueError(
                f"cannot keep {length} of {len(self._cached)} cached tokens"
                + " (sliding-window rings)" * bool(self.layout.rings)
            )
        self._cached = self._cached[:length]
        self.slots.next = self.slots.first + length
        self.slots.position = length
        for bound in self.prefill_variants + self.generate_variants:
            bound.binding.reset()  # staged pasts mirror the slots again

    # -- one slot of several (packed generate models: .packed) --------------------------------
    def wrote(self, token: int) -> None:
        """A packed step fed ``token`` and wrote its KV into this runner's next slot: account
        it as :meth:`step` does."""
        if self.slots.keeps_next:
            self._cached.append(int(token))
        self.slots.advance()
        self._at_switch = False

    @property
    def cached_ids(self) -> list[int]:
        """The token ids whose KV the last sequence left in its slots (a copy)."""
        return list(self._cached)

    def cached_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` of a prompt this runner's last sequence holds the KV of
        (one left to run, as a continuation needs: :func:`.prompt_reuse.shared_prefix`)."""
        return shared_prefix(self._cached, np.asarray(tokens, np.int64))

    def copy_from(self, other: StaticRunner) -> int:
        """Take ``other``'s sequence: its KV (the slots it holds, in every buffer) and where
        it stands (a beam parting from another); the bytes copied."""
        if other.cache.specs.keys() != self.cache.specs.keys():
            raise ValueError("runners of different models")
        before, held = self.copied.bytes, min(other.slots.next, other.cache.capacity)
        for name, spec in other.cache.specs.items():
            if spec.ring:  # a ring's slots are not in token order: all of it
                safe_copy(self.cache.array(name), other.cache.array(name), self.copied)
                continue
            for a, b, _ in other.cache.pieces(name, 0, held) if held else ():
                safe_copy(self.cache.rows(name, a, b), other.cache.rows(name, a, b), self.copied)
        self.slots = Slots(other.slots.capacity, other.slots.first, other.slots.next)
        self.slots.position = other.slots.position
        self._cached = other.cached_ids
        for bound in self.prefill_variants + self.generate_variants:
            bound.binding.reset()  # staged pasts mirror the slots again
        return self.copied.bytes - before
