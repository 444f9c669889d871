"""A property-based fuzz of ``ContinuousBatchingPipeline``'s request API: requests added,
stepped, read, stopped and cancelled in any order, ``LLMPipeline`` calls on the same engine
from other threads (some with streamers raising ``KeyboardInterrupt``), and Ctrl-C landing in
the model call of any step.  Every request that finishes gets the tokens it gets alone, a
stopped one a prefix of them; only the interrupted call raises; the block manager's
invariants hold after every step and nothing is left live at the end."""

from __future__ import annotations

import threading
import traceback
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import make_tiny_gguf
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from npuw_kv import ContinuousBatchingPipeline, LLMPipeline
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.model.source import resolve_model

Status = openvino_genai.GenerationStatus
PROMPTS = [[1, 5, 9, 13], [1, 7] * 9, list(range(3, 40)), [1, 5, 9, 13, 20, 21, 22]]
LONGEST = 8  # new tokens at most


class InterruptAt:
    """``runner.last_logits`` raising KeyboardInterrupt at its ``at``-th call from now, as
    Ctrl-C landing in a step's model call does; which thread it hit."""

    def __init__(self, call: Any, at: int) -> None:
        self.call, self.at = call, at
        self.thread: threading.Thread | None = None

    def __call__(self, parts: Any) -> Any:
        self.at -= 1
        if self.at == 0:
            self.thread = threading.current_thread()  # an ident may be reused
            raise KeyboardInterrupt
        return self.call(parts)


class Interrupting:
    """A streamer that raises KeyboardInterrupt at its ``at``-th piece (0: never)."""

    def __init__(self, at: int) -> None:
        self.at, self.pieces = at, 0

    def __call__(self, text: str) -> None:
        self.pieces += 1
        if self.pieces == self.at:
            raise KeyboardInterrupt


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """The state machine's class over one tiny pipeline (a millisecond a step), and each
    prompt's tokens alone."""
    root = tmp_path_factory.mktemp("fuzz-cb")
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    model = resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)
    settings_ = {**EXACT_F32, "attention_backend": "pa", "kv_precision": "f32"}
    cb = ContinuousBatchingPipeline(model, None, "CPU", settings_)
    pipe = LLMPipeline(cb.engine)
    real = cb.runner.last_logits
    alone = [
        list(pipe.generate(p, max_new_tokens=LONGEST, ignore_eos=True).tokens) for p in PROMPTS
    ]

    class Requests(RuleBasedStateMachine):
        handles = Bundle("handles")

        def __init__(self) -> None:
            super().__init__()
            self.added: list[tuple[Any, list[int], list[int]]] = []  # handle, wanted, read
            self.threads: list[tuple[threading.Thread, dict[str, Any]]] = []
            self.armed: InterruptAt | None = None
            self.disarm()  # an example hypothesis ended early may have left one armed

        # -- the request API ------------------------------------------------------------------
        @rule(target=handles, prompt=st.integers(0, len(PROMPTS) - 1), new=st.integers(1, LONGEST))
        def add(self, prompt: int, new: int) -> Any:
            config = openvino_genai.GenerationConfig()
            config.max_new_tokens, config.ignore_eos = new, True
            ids = ov.Tensor(np.asarray(PROMPTS[prompt], np.int64)[None])
            handle = cb.add_request(len(self.added), ids, config)
            self.added.append((handle, alone[prompt][:new], []))
            return len(self.added) - 1

        @rule()
        def step(self) -> None:
            try:
                cb.step()
            except KeyboardInterrupt:
                event("Ctrl-C in step()")
                assert self.armed is not None and self.armed.thread is threading.current_thread()
                self.disarm()

        @rule(index=handles)
        def read(self, index: int) -> None:
            handle, wanted, got = self.added[index]
            if handle.get_status() == Status.CANCEL:
                return
            for output in handle.read().values():
                got.extend(output.generated_ids)
            assert got == wanted[: len(got)]

        @rule(index=handles)
        def stop(self, index: int) -> None:
            self.added[index][0].stop()

        @rule(index=handles)
        def cancel(self, index: int) -> None:
            self.added[index][0].cancel()

        @rule(at=st.integers(1, 4))
        def arm(self, at: int) -> None:
            """Ctrl-C in the model call of one of the next steps (ours or a thread's)."""
            if self.armed is None:
                self.armed = InterruptAt(real, at)
                cb.runner.last_logits = self.armed

        def disarm(self) -> None:
            cb.runner.last_logits = real
            self.armed = None

        # -- calls from other threads ---------------------------------------------------------
        @precondition(lambda self: len(self.threads) < 3)
        @rule(prompt=st.integers(0, len(PROMPTS) - 1), new=st.integers(1, LONGEST),
              kbi=st.integers(0, 4))  # fmt: skip
        def call_from_a_thread(self, prompt: int, new: int, kbi: int) -> None:
            record: dict[str, Any] = {"wanted": alone[prompt][:new], "streamer": Interrupting(kbi)}

            def run() -> None:
                record["thread"] = threading.current_thread()
                try:
                    result = pipe.generate(
                        PROMPTS[prompt], max_new_tokens=new, ignore_eos=True,
                        streamer=record["streamer"],
                    )  # fmt: skip
                    record["tokens"] = list(result.tokens)
                except BaseException as exc:  # noqa: BLE001 - checked at the join
                    record["raised"] = exc

            thread = threading.Thread(target=run)
            thread.start()
            self.threads.append((thread, record))

        @rule()
        def join(self) -> None:
            for thread, record in self.threads:
                thread.join(timeout=60)
                assert not thread.is_alive(), "a call from a thread hangs"
                self._check_thread(record)
            self.threads = []

        def _check_thread(self, record: dict[str, Any]) -> None:
            raised = record.get("raised")
            if raised is None:
                assert record["tokens"] == record["wanted"]
                return
            assert isinstance(raised, KeyboardInterrupt), raised
            event("a thread's call interrupted")
            streamer = record["streamer"]
            hit = self.armed is not None and self.armed.thread is record["thread"]
            assert hit or streamer.pieces == streamer.at, "".join(
                traceback.format_exception(raised)
            )
            if hit:
                self.disarm()

        @invariant()
        def blocks_hold(self) -> None:
            if not any(thread.is_alive() for thread, _ in self.threads):
                cb.runner.blocks.check_invariants()

        def teardown(self) -> None:
            self.join()
            self.disarm()
            while cb.has_non_finished_requests():
                cb.step()
            for handle, wanted, _ in self.added:
                status = handle.get_status()
                if status == Status.CANCEL:
                    continue
                (output,) = handle.read_all()
                if status == Status.FINISHED:
                    assert output.generated_ids == wanted
                else:
                    assert status == Status.STOP, status
                    assert output.generated_ids == wanted[: len(output.generated_ids)]
            cb.runner.blocks.check_invariants()
            assert not cb.runner.blocks.sequence_ids

    return Requests


@pytest.mark.slow(seconds=35)
def test_the_request_api_against_each_request_alone(machine):
    run = machine.TestCase()
    run.settings = settings(
        max_examples=500,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    run.runTest()
