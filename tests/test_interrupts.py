"""A KeyboardInterrupt from one call's streamer, in a batched step: that call's sequences end
(their blocks back, no streamer of it hears more) and it raises the interrupt in its own
thread; the other calls go on and get the tokens they get alone (robustness round 4)."""

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

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert list(raised) == [1] and isinstance(raised[1], KeyboardInterrupt)
    assert {i: got[i] for i in (0, 2, 3)} == {i: want[i] for i in (0, 2, 3)}
    assert not late
    pipe.runner.blocks.check_invariants()
    assert not pipe.runner.blocks.sequence_ids
