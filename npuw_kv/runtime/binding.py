"""Binding one infer request's past inputs and present outputs to the shared KV cache.

``roi`` mode hands the device strided views of the shared buffers: the past input is the view
``[0, past_len)`` (bound once), each present output the view of the slots being written (rebound
per step).  Nothing is copied on the host.  A model with split past inputs (``past`` and
``past.tail``, see :func:`npuw_kv.model.transforms.split_past`) reads a split cache: the prefix
segment through ``past`` and slots ``[split, past_len)`` through the tail, both contiguous.

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
        split_past: bool = False,
    ) -> None:
        if past_len > cache.capacity:
            raise ValueError(f"past length {past_len} exceeds KV capacity {cache.capacity}")
        split = cache.split_at
        if split is not None and (not split_past or mode != "roi" or past_len < split):
            raise ValueError(
                f"a KV cache split at slot {split} needs a split-past model bound in roi mode "
                f"with a past of at least {split} slots (got {mode}, past {past_len})"
            )
        self.request = request
        self.ports = ports
        self.cache = cache
        self.past_len = past_len
        self.new_tokens = new_tokens
        self.mode = mode
        self.counter = counter
        self._synced = 0
        self._staging_in: dict[str, np.ndarray] = {}
        self._staging_out: dict[str, np.ndarray] = {}
        self._scratch: dict[str, ov.Tensor] = {}
        head = past_len if split is None else split
        for port in ports:
            if split_past:
                tail = (
                    cache.view(port.name, head, past_len)
                    if past_len > head
                    else self._empty(port.name)
                )
                request.set_tensor(tail_input(port.name), tail)
            if mode == "roi" and head == 0:
                # one chunk covers MAX_PROMPT_LEN: the prefill has no past at all
                request.set_tensor(port.name, self._empty(port.name))
            elif mode == "roi":
                request.set_tensor(port.name, cache.view(port.name, 0, head))
            else:
                past = cache.zeros(port.name, past_len)
                new = cache.zeros(port.name, new_tokens)
                self._staging_in[port.name] = past
                self._staging_out[port.name] = new
                request.set_tensor(port.name, cache.tensor(past))
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
