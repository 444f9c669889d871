"""Binding one infer request's past inputs and present outputs to the shared KV cache.

``roi`` mode hands the device views of the shared buffers: the past input is the view
``[0, past_len)`` (bound once), each present output the view of the slots being written (rebound
per step).  Nothing is copied on the host.  A model with a split, sliced past (``past`` read up
to the mask length, then ``past.tail``; see :func:`npuw_kv.model.transforms.slice_past`) only
ever gets the whole buffer, contiguous: a *growing* binding (the prefill) binds it as ``past``
and reads slots ``[0, start)`` through a mask of ``start + C``; the generate step binds it as
the tail.  In copy mode the staging takes those places and the prefill's past does not grow.

``copy`` mode is for devices that refuse strided tensors: the request gets contiguous staging
tensors; before an inference the rows that changed since the last sync are copied into the past
staging, after it the present staging is copied into its slots.  Every byte is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from ..kv.cache import SharedKVCache
from ..kv.copy import CopyCounter, safe_copy
from ..model.transforms import tail_input


@dataclass(frozen=True)
class BoundPort:
    name: str  # past input name == cache buffer name
    output_index: int


class KVBinding:
    def __init__(
        self,
        request: ov.InferRequest,
        ports: list[BoundPort],
        cache: SharedKVCache,
        past_len: int,
        new_tokens: int,
        mode: str,
        counter: CopyCounter,
        sliced: bool = False,
        grow: bool = False,
    ) -> None:
        if past_len > cache.capacity:
            raise ValueError(f"past length {past_len} exceeds KV capacity {cache.capacity}")
        self.request = request
        self.ports = ports
        self.cache = cache
        self.past_len = past_len
        self.new_tokens = new_tokens
        self.mode = mode
        self.counter = counter
        # roi on a sliced-past model: each chunk reads exactly the slots before it
        self.grow = grow and sliced and mode == "roi"
        if sliced and mode == "roi" and not grow and past_len != cache.capacity:
            raise ValueError(
                "a sliced-past model reads a growing prefix (prefill) or the whole buffer "
                f"(generate), not a fixed past of {past_len} slots"
            )
        self._synced = 0
        self._staging_in: dict[str, np.ndarray] = {}
        self._staging_out: dict[str, np.ndarray] = {}
        self._scratch: dict[str, ov.Tensor] = {}
        whole = (0, cache.capacity)
        for port in ports:
            # a sliced-past model: the prefill reads through the sliced past, the generate step
            # through the unsliced tail (a slice would copy every step); the other stays empty
            target = tail_input(port.name) if sliced and not grow else port.name
            if sliced:
                other = port.name if target != port.name else tail_input(port.name)
                request.set_tensor(other, self._empty(port.name))
            if mode == "roi" and sliced:  # growing (prefill) or whole (generate), checked above
                # for the prefill, the chunk's output view [start, start + C) lies in this same
                # buffer, past the slice the mask sets: the request never reads what it writes
                request.set_tensor(target, cache.view(port.name, *whole))
            elif mode == "roi" and past_len == 0:
                # one chunk covers MAX_PROMPT_LEN: the prefill has no past at all
                request.set_tensor(target, self._empty(port.name))
            elif mode == "roi":
                request.set_tensor(target, cache.view(port.name, 0, past_len))
            else:
                past = cache.zeros(port.name, past_len)
                new = cache.zeros(port.name, new_tokens)
                self._staging_in[port.name] = past
                self._staging_out[port.name] = new
                request.set_tensor(target, cache.tensor(past))
                request.set_output_tensor(port.output_index, cache.tensor(new))

    def _empty(self, name: str) -> ov.Tensor:
        """A zero-length past, for a port that has nothing to read."""
        return self.cache.tensor(self.cache.zeros(name, 0))

    def reset(self) -> None:
        """Forget what the staging holds (a new prompt rewrites the cache)."""
        self._synced = 0

    def before(self, write_slots: tuple[int, int], live_end: int) -> None:
        """Point outputs at ``write_slots``; in copy mode sync past rows ``< live_end``."""
        start, stop = write_slots
        if stop - start != self.new_tokens:
            raise ValueError(f"write of {stop - start} rows into a {self.new_tokens}-row output")
        if self.mode == "roi":
            for port in self.ports:
                self.request.set_output_tensor(
                    port.output_index, self._output_view(port.name, start, stop)
                )
            return
        end = min(live_end, self.past_len)
        if end > self._synced:
            for port in self.ports:
                safe_copy(
                    self._staging_in[port.name][:, :, self._synced : end, :],
                    self.cache.rows(port.name, self._synced, end),
                    self.counter,
                )
            self._synced = end

    def _output_view(self, name: str, start: int, stop: int) -> ov.Tensor:
        if stop <= self.cache.capacity:
            return self.cache.view(name, start, stop)
        # The very last step's KV is never read again (the cache is then full): discard it.
        if name not in self._scratch:
            self._scratch[name] = self.cache.tensor(self.cache.zeros(name, self.new_tokens))
        return self._scratch[name]

    def after(self, write_slots: tuple[int, int]) -> None:
        """In copy mode, move the new rows from staging into their slots."""
        start, stop = write_slots
        if self.mode == "roi" or stop > self.cache.capacity:
            return
        for port in self.ports:
            safe_copy(
                self.cache.rows(port.name, start, stop), self._staging_out[port.name], self.counter
            )
        # rows rewritten below the synced mark must be re-synced next time
        self._synced = min(self._synced, start)
