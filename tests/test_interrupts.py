"""A KeyboardInterrupt in a batched step, from one call's streamer or landing in the model call
(Ctrl-C): that call's sequences end (their blocks back, no streamer of it hears more) and it
raises the interrupt in its own thread; the other calls go on and get the tokens they get
alone (robustness round 4)."""

from __future__ import annotations

import threading

import numpy as np
import openvino as ov
import pytest
from conftest import make_pipe

PA_F32 = {"attention_backend": "pa", "kv_precision": "f32"}  # make_pipe adds exact f32


class Interrupting:
    """A text streamer that raises KeyboardInterrupt at its ``at``-th piece."""

    def __init__(self, at: int) -> None:
        self.at, self.pieces = at, []

    def __call__(self, text: str) -> None:
        self.pieces.append(text)
        if len(self.pieces) == self.at:
            raise KeyboardInterrupt


def _run_at_once(call, count: int) -> None:
    """``call(i)`` for each i in its own thread; back once all have ended."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)


def _alone(pipe, ids, new: int) -> list[int]:
    return list(pipe.generate(ids, max_new_tokens=new, ignore_eos=True).tokens)


def test_an_interrupted_call_leaves_no_ghosts(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU", **PA_F32)
    heard: list[str] = []
    kbi = Interrupting(3)
    ids = ov.Tensor(np.asarray(text_ids(30), np.int64)[None])  # several answers: a tensor
    with pytest.raises(KeyboardInterrupt):
        pipe.generate(
            ids,
            max_new_tokens=20,
            do_sample=True,
            rng_seed=5,
            num_return_sequences=2,
            ignore_eos=True,
            streamer=[heard.append, kbi],
        )
    assert len(kbi.pieces) == 3
    after = len(heard)
    batch = pipe.engine.batch
    assert batch is not None and not batch.busy  # nothing left running
    blocks = pipe.runner.blocks
    blocks.check_invariants()
    assert not blocks.sequence_ids
    other = [int(t) for t in text_ids(50)][20:]
    got = _alone(pipe, other, 12)  # an unrelated call: the ended call's streamer hears nothing
    assert len(heard) == after
    assert got == _alone(pipe, other, 12)


def test_an_interrupt_in_one_thread_leaves_the_other_calls_their_tokens(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU", **PA_F32)
    prompts = [[int(t) for t in text_ids(n)][n // 3 :] for n in (40, 90, 150, 200)]
    want = [_alone(pipe, p, 16) for p in prompts]
    start = threading.Barrier(4)
    got: dict[int, list[int]] = {}
    raised: dict[int, BaseException] = {}
    late: list[str] = []  # pieces that reached the interrupted call's streamer after it ended
    ended = threading.Event()
    kbi = Interrupting(4)

    def streamer(text: str) -> None:
        if ended.is_set():
            late.append(text)
        kbi(text)

    def call(i: int) -> None:
        start.wait()
        try:
            result = pipe.generate(
                prompts[i],
                max_new_tokens=16,
                ignore_eos=True,
                streamer=streamer if i == 1 else None,
            )
            got[i] = list(result.tokens)
        except BaseException as exc:  # noqa: BLE001 - the test records where it came out
            ended.set()
            raised[i] = exc

    _run_at_once(call, 4)
    assert list(raised) == [1] and isinstance(raised[1], KeyboardInterrupt)
    assert {i: got[i] for i in (0, 2, 3)} == {i: want[i] for i in (0, 2, 3)}
    assert not late
    pipe.runner.blocks.check_invariants()
    assert not pipe.runner.blocks.sequence_ids


class InterruptAt:
    """``runner.last_logits`` (the model call of a batched step) raising KeyboardInterrupt
    at its ``at``-th call, as Ctrl-C landing in the model call does; which thread ran it."""

    def __init__(self, runner, at: int) -> None:
        self.call, self.at, self.calls = runner.last_logits, at, 0
        self.thread: threading.Thread | None = None

    def __call__(self, parts):
        self.calls += 1
        if self.calls == self.at:
            self.thread = threading.current_thread()  # an ident may be reused
            raise KeyboardInterrupt
        return self.call(parts)


@pytest.mark.parametrize("at", [3, 9])
def test_ctrl_c_in_the_model_call_ends_only_the_stepping_threads_call(
    smol_dir, text_ids, monkeypatch, at
):
    pipe = make_pipe(smol_dir, "CPU", **PA_F32)
    prompts = [[int(t) for t in text_ids(n)][n // 3 :] for n in (40, 90, 150, 200)]
    want = [_alone(pipe, p, 12) for p in prompts]
    interrupt = InterruptAt(pipe.runner, at)
    monkeypatch.setattr(pipe.runner, "last_logits", interrupt)
    start = threading.Barrier(4)
    got: dict[int, list[int]] = {}
    raised: dict[int, BaseException] = {}
    threads: dict[int, threading.Thread] = {}

    def call(i: int) -> None:
        threads[i] = threading.current_thread()
        start.wait()
        try:
            got[i] = list(pipe.generate(prompts[i], max_new_tokens=12, ignore_eos=True).tokens)
        except BaseException as exc:  # noqa: BLE001 - the test records where it came out
            raised[i] = exc

    _run_at_once(call, 4)
    assert interrupt.thread is not None
    (stepper,) = [i for i, thread in threads.items() if thread is interrupt.thread]
    assert list(raised) == [stepper] and isinstance(raised[stepper], KeyboardInterrupt)
    assert got == {i: want[i] for i in range(4) if i != stepper}  # read again, the same tokens
    pipe.runner.blocks.check_invariants()
    assert not pipe.runner.blocks.sequence_ids
    assert not pipe.engine.batch.busy
    assert _alone(pipe, prompts[stepper], 12) == want[stepper]


def test_ctrl_c_in_continuous_batchings_step_keeps_every_request(smol_dir, text_ids, monkeypatch):
    """genai's request API: the interrupt comes out of ``step()``; the requests stay, and the
    next steps finish them with the tokens each gets alone."""
    import openvino_genai

    from npuw_kv import ContinuousBatchingPipeline
    from npuw_kv.config import EXACT_F32

    cb = ContinuousBatchingPipeline(smol_dir, None, "CPU", {**EXACT_F32, **PA_F32})
    prompts = [np.asarray(text_ids(n)[n // 3 :], np.int64) for n in (40, 120)]
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 10, True
    want = [
        r.m_generation_ids[0] for r in cb.generate([ov.Tensor(p[None]) for p in prompts], config)
    ]
    handles = [cb.add_request(i, ov.Tensor(p[None]), config) for i, p in enumerate(prompts)]
    cb.step()
    monkeypatch.setattr(cb.runner, "last_logits", InterruptAt(cb.runner, 2))
    cb.step()
    with pytest.raises(KeyboardInterrupt):
        cb.step()
    assert all(h.get_status() == openvino_genai.GenerationStatus.RUNNING for h in handles)
    while cb.has_non_finished_requests():
        cb.step()
    assert [h.read_all()[0].generated_ids for h in handles] == want
    cb.runner.blocks.check_invariants()
