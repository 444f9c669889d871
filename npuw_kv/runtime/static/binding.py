"""Binding one infer request's past inputs and present outputs to the shared KV cache.

Three modes (``kv_binding``), differing in which tensors the device gets as views of the
shared buffers and which through dense host staging:

``roi`` hands the device views of the shared buffers: the past input is the view
``[0, past_len)`` (bound once), each present output the view of the slots being written (rebound
per step).  Nothing is copied on the host.  A model with a split, sliced past (``past`` read up
to the mask length, then ``past.tail``; see :func:`npuw_kv.model.transforms.slice_past`) only
ever gets the whole buffer, contiguous: a *growing* binding (the prefill) binds it as ``past``
and reads slots ``[0, start)`` through a mask of ``start + C``; the generate step binds it as
the tail.  In copy mode the staging takes those places and the prefill's past does not grow.

``copy`` mode is for devices that refuse strided tensors: the request gets contiguous staging
tensors; before an inference the rows that changed since the last sync are copied into the past
staging, after it the present staging is copied into its slots.  Every byte is counted.

``contiguous`` mode is NPUW's guard: bind a view directly only when it is dense
(``is_continuous()``), stage only the strided ones, as copy mode does.  A device that refuses
strided tensors (a real NPU without ``NPU_ENABLE_STRIDES_FOR``) must get dense tensors, but a
contiguous view already is one, so copying it would be waste.  A ``[1, H, L, D]`` buffer's slot
range is contiguous when ``H == 1`` (any range), and for ``H > 1`` only as the whole buffer: the
generate request's past (the whole buffer) is then read in place while the prefill's past
``[0, MAX_PROMPT_LEN - C)`` and every present output view are staged.  A sliced-past model binds
only the whole buffer as its past, so it behaves like ``roi`` there; its outputs follow the guard.
``past_paths`` and ``output_paths`` record which way each port went.

Each port carries its sequence axis: 2 (``[1, H, S, D]``), or 3 for V stored transposed
(``[1, H, D, S]``, ``optimize_v_tensors``), where a slot range cuts the innermost axis.  Such a
view is strided even with one head (only the whole buffer is dense), so the contiguous guard
stages every transposed-V past but the generate model's whole buffer, and every transposed-V
output.  A port whose axis differs from the buffer's (V transposed in one phase only) gets
views of the same memory in its own layout (:meth:`SharedKVCache.view`'s ``seq_axis``).

A cache held as blocks (``SharedKVCache.edges``): a model whose past ends within the first block
reads a view of it (the whole block where the past ends on its edge: dense); a longer one has
its past split in one input per block (``transforms.split_past``), each bound to the block's
slots below the past (whole blocks where the past ends on an edge, as the static shapes lay
them out).  A present write that crosses an edge is staged and copied in pieces.

A sliding-window layer kept as a ring (``BoundPort.ring``, :mod:`npuw_kv.model.ring`) is read
whole by every model, as the generate past is (dense: the guard binds it directly), and never
split or sliced; its outputs go to ring slots ``start mod R``.  A write that would wrap around
the ring's end (a continuation's chunk off the chunk grid) is staged and copied in two pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import openvino as ov

from ...config.settings import KV_BINDINGS
from ...kv.cache import SEQ_AXIS, SharedKVCache
from ...kv.copy import CopyCounter
from ...model.transforms import tail_input

# how a port's tensor reaches the request: the cache's own memory, or dense host staging
BindPath = Literal["direct", "staged"]


@dataclass(frozen=True)
class BoundPort:
    name: str  # past input name == cache buffer name
    output_index: int
    seq_axis: int = SEQ_AXIS  # 3: V transposed, [1, H, D, S]
    ring: int = 0  # > 0: a sliding-window layer's ring of that many slots


def _input_names(request: ov.InferRequest) -> set[str]:
    return {name for port in request.get_compiled_model().inputs for name in port.get_names()}


class KVBinding:
    """One request's past inputs and present outputs, bound per ``mode`` (module docstring).

    ``past_paths[name]``: how port ``name``'s past input was bound (once, at construction).
    ``output_paths[name]``: how its present output was bound for the current step (set by
    :meth:`before`); ``outputs_direct`` / ``outputs_staged`` count the output bindings of each
    kind since the last :meth:`reset` (a new prompt).  Staged bytes go to ``counter``.
    """

    def __init__(
        self,
        request: ov.InferRequest,
        ports: list[BoundPort],
        cache: SharedKVCache,
        *,
        past_len: int,
        new_tokens: int,
        mode: str,
        counter: CopyCounter,
        sliced: bool = False,
        grow: bool = False,
        strided_outputs: bool = True,
    ) -> None:
        """``strided_outputs``: a strided output view may be bound (else staged, as an NPU
        needs without ``NPU_ENABLE_STRIDES_FOR``; contiguous views are still bound)."""
        if mode not in KV_BINDINGS:
            raise ValueError(f"kv_binding {mode!r} not in {KV_BINDINGS}")
        if past_len > cache.capacity:
            raise ValueError(f"past length {past_len} exceeds KV capacity {cache.capacity}")
        self.request = request
        self.ports = ports
        self.cache = cache
        self.past_len = past_len
        self.new_tokens = new_tokens
        self.mode = mode
        self.counter = counter
        self.strided_outputs = strided_outputs
        # the past of a sliced-past model is the whole buffer, contiguous: only copy stages it
        views = mode != "copy"
        # a view mode on a sliced-past model: each chunk reads exactly the slots before it
        self.grow = grow and sliced and views
        if sliced and views and not grow and past_len != cache.capacity:
            raise ValueError(
                "a sliced-past model reads a growing prefix (prefill) or the whole buffer "
                f"(generate), not a fixed past of {past_len} slots"
            )
        self.past_paths: dict[str, BindPath] = {}
        self.output_paths: dict[str, BindPath] = {}
        self.outputs_direct = 0
        self.outputs_staged = 0
        self.staged_output_bytes = 0  # of counter's bytes: staged outputs copied into slots
        self._synced = 0
        self._ring_synced = 0  # token slots before this are in the rings' staging
        # staged past inputs: input name -> (buffer name, its first slot, the dense array)
        self._staging_in: dict[str, tuple[str, int, np.ndarray]] = {}
        # past inputs bound as they are: (buffer name, first slot, stop)
        self._direct_in: set[tuple[str, int, int]] = set()
        self._staging_out: dict[str, np.ndarray] = {}
        self._staging_out_tensors: dict[str, ov.Tensor] = {}
        self._scratch: dict[str, ov.Tensor] = {}
        # what this binding set on the request, to set again after another binding of the
        # same request (another sequence's region: rebind)
        self._inputs: dict[str, ov.Tensor] = {}
        self._outputs: dict[int, ov.Tensor] = {}
        self._axis = {port.name: port.seq_axis for port in ports}
        self._ring = {port.name: port.ring for port in ports if port.ring}
        whole = (0, cache.capacity)
        inputs = _input_names(request) if past_len == 0 and not sliced else set()
        for port in ports:
            axis = port.seq_axis
            if port.ring:
                self._bind_ring(port)
                continue
            if past_len == 0 and not sliced and port.name not in inputs:
                # the model of no past has no past inputs (model/empty_inputs.py): only its
                # output is bound, in past_paths nothing
                if mode == "copy":
                    self._set_output(port.output_index, self._output_staging(port.name))
                continue
            # a sliced-past model: the prefill reads through the sliced past, the generate step
            # through the unsliced tail (a slice would copy every step); the other stays empty
            target = tail_input(port.name) if sliced and not grow else port.name
            if sliced:
                other = port.name if target != port.name else tail_input(port.name)
                self._set_input(other, self._empty(port.name))
            path: BindPath
            pieces = [] if sliced else cache.pieces(port.name, 0, past_len)
            if len(pieces) > 1:  # a past over several blocks: one input per block
                paths = {
                    self._bind_past(port, tail_input(port.name, part), a, b, views)
                    for part, (a, b, _) in enumerate(pieces)
                }
                path = "direct" if paths == {"direct"} else "staged"
            elif views and sliced:  # growing (prefill) or whole (generate), checked above
                # for the prefill, the chunk's output view [start, start + C) lies in this same
                # buffer, past the slice the mask sets: the request never reads what it writes
                view = cache.view(port.name, *whole, axis)
                path = self._set_past(port, target, 0, view, past_len)
            elif views and past_len == 0:
                # no past at all: one chunk covers MAX_PROMPT_LEN, or a prefill model of past 0
                path = self._set_past(port, target, 0, self._empty(port.name))
            else:
                path = self._bind_past(port, target, 0, past_len, views)
            self.past_paths[port.name] = path
            if mode == "copy":  # bound once; the other modes bind their outputs per step
                self._set_output(port.output_index, self._output_staging(port.name))

    def _set_input(self, name: str, tensor: ov.Tensor) -> None:
        self.request.set_tensor(name, tensor)
        self._inputs[name] = tensor

    def _set_output(self, index: int, tensor: ov.Tensor) -> None:
        self.request.set_output_tensor(index, tensor)
        self._outputs[index] = tensor

    def rebind(self) -> None:
        """Set this binding's tensors on the request again: the request ran another
        sequence's region (packed slots) since; outputs bound per step are bound by
        :meth:`before` anyway."""
        for name, tensor in self._inputs.items():
            self.request.set_tensor(name, tensor)
        for index, tensor in self._outputs.items():
            self.request.set_output_tensor(index, tensor)

    def _bind_past(
        self, port: BoundPort, target: str, start: int, stop: int, views: bool
    ) -> BindPath:
        """Input ``target`` reads slots ``[start, stop)`` of ``port``'s buffer: the view, or
        (copy mode, or a strided view under the guard) a dense staging array."""
        view = self.cache.view(port.name, start, stop, port.seq_axis) if views else None
        return self._set_past(port, target, start, view, stop - start)

    def _set_past(
        self, port: BoundPort, target: str, start: int, view: ov.Tensor | None, rows: int = 0
    ) -> BindPath:
        """Bind ``view`` (slots from ``start``) to ``target`` if it goes as it is, else a dense
        staging array of ``rows`` slots that :meth:`before` keeps in sync."""
        if view is not None and self._direct(view):
            self._set_input(target, view)
            # the slots the bound tensor spans (a sliced past binds the whole buffer)
            self._direct_in.add((port.name, start, start + view.get_shape()[port.seq_axis]))
            return "direct"
        past = self.cache.zeros(port.name, rows, port.seq_axis)
        self._staging_in[target] = (port.name, start, past)
        self._set_input(target, self.cache.tensor(past))
        return "staged"

    def _bind_ring(self, port: BoundPort) -> None:
        """A ring's past: the whole ring, in every model and mode but copy (staged whole)."""
        view = self.cache.view(port.name, 0, port.ring, port.seq_axis)
        self.past_paths[port.name] = self._set_past(port, port.name, 0, view, port.ring)
        if self.mode == "copy":
            self._set_output(port.output_index, self._output_staging(port.name))

    def _direct(self, tensor: ov.Tensor) -> bool:
        """Whether ``tensor`` goes to the request as it is (else through dense staging)."""
        if self.mode == "contiguous":
            return bool(tensor.is_continuous())
        return self.mode == "roi"

    def _empty(self, name: str) -> ov.Tensor:
        """A zero-length past, for a port that has nothing to read."""
        return self.cache.tensor(self.cache.zeros(name, 0, self._axis[name]))

    def _output_staging(self, name: str) -> ov.Tensor:
        """The dense tensor port ``name``'s present rows are written to when staged."""
        if name not in self._staging_out_tensors:
            new = self.cache.zeros(name, self.new_tokens, self._axis[name])
            self._staging_out[name] = new
            self._staging_out_tensors[name] = self.cache.tensor(new)
        return self._staging_out_tensors[name]

    def reset(self) -> None:
        """Forget what the staging holds (a new prompt rewrites the cache)."""
        self._synced = 0
        self._ring_synced = 0
        self.outputs_direct = 0
        self.outputs_staged = 0
        self.staged_output_bytes = 0

    def before(self, write_slots: tuple[int, int], live_end: int) -> None:
        """Point outputs at ``write_slots``; sync staged past rows ``< live_end``."""
        start, stop = write_slots
        if stop - start != self.new_tokens:
            raise ValueError(f"write of {stop - start} rows into a {self.new_tokens}-row output")
        for port in self.ports:
            path = self._bind_output(port, start, stop)
            self.output_paths[port.name] = path
            if path == "direct":
                self.outputs_direct += 1
            else:
                self.outputs_staged += 1
        end = min(live_end, self.past_len)
        for name, first, past in self._staging_in.values():
            axis, ring = self._axis[name], self._ring.get(name, 0)
            if ring:  # the staged ring mirrors the whole ring
                lo = max(self._ring_synced, live_end - ring)
                hi = max(lo, live_end)
            else:
                lo, hi = max(self._synced, first), min(end, first + past.shape[axis])
            if hi > lo:
                self.cache.mirror(name, lo, hi, past, first, axis, self.counter)
        self._synced = max(self._synced, end)
        self._ring_synced = max(self._ring_synced, live_end)

    def _bind_output(self, port: BoundPort, start: int, stop: int) -> BindPath:
        """Point ``port``'s output at slots ``[start, stop)``: their view, or its staging."""
        if self.mode == "copy":  # copy mode's output staging is bound for good
            return "staged"
        view = self._output_view(port.name, start, stop)
        direct = view is not None and self._direct(view)
        if direct and not self.strided_outputs:
            direct = bool(view.is_continuous())  # type: ignore[union-attr]
        if not direct:
            view = self._output_staging(port.name)
        self.request.set_output_tensor(port.output_index, view)
        return "direct" if direct else "staged"

    def stage_strided_outputs(self, write_slots: tuple[int, int]) -> None:
        """From now on, stage every strided output (the device refused one at ``infer()``:
        an NPU without strides for its ports), and rebind this step's outputs that way."""
        self.strided_outputs = False
        for port in self.ports:
            if self.output_paths.get(port.name) != "direct":
                continue
            path = self._bind_output(port, *write_slots)
            if path == "staged":
                self.output_paths[port.name] = path
                self.outputs_direct -= 1
                self.outputs_staged += 1

    def _output_view(self, name: str, start: int, stop: int) -> ov.Tensor | None:
        """The view slots ``[start, stop)`` are written through; None: it must be staged."""
        if stop <= self.cache.capacity:
            pieces = self.cache.pieces(name, start, stop)
            if len(pieces) > 1:  # crosses a block edge or wraps round a ring: staged
                return None
            first, last, _ = pieces[0]
            if (name, first, last) in self._direct_in:
                # the output would be the very tensor a past input reads (a KV block of one
                # chunk): NPUW then gives wrong results from the next call on (measured, f16
                # KV, folded or not); staged instead
                return None
            return self.cache.view(name, first, last, self._axis[name])
        # The very last step's KV is never read again (the cache is then full): discard it.
        # The scratch is a dense array, so even the contiguous guard binds it directly.
        if name not in self._scratch:
            scratch = self.cache.zeros(name, self.new_tokens, self._axis[name])
            self._scratch[name] = self.cache.tensor(scratch)
        return self._scratch[name]

    def after(self, write_slots: tuple[int, int]) -> None:
        """Move the new rows of staged outputs from staging into their slots."""
        start, stop = write_slots
        if stop > self.cache.capacity:  # the last step: its KV is discarded
            return
        copied = self.counter.bytes
        for port in self.ports:
            if self.output_paths.get(port.name) != "staged":
                continue
            new, axis = self._staging_out[port.name], port.seq_axis
            self.cache.write(port.name, start, stop, new, axis, self.counter)
        self.staged_output_bytes += self.counter.bytes - copied
        # rows rewritten below the synced mark (by staging or in place) must be re-synced
        self._synced = min(self._synced, start)
        self._ring_synced = min(self._ring_synced, start)
