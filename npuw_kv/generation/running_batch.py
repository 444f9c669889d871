"""The paged path's one running batch, which calls from several threads join.

Each call adds its sequences (a :class:`Ticket`) between two steps and then waits for them;
whichever waiting thread finds no step running runs the next one, for every live sequence, so
the calls share steps instead of queueing behind each other.  A thread that wants to add
sequences goes before the next step (new requests join at once).  A sequence's streamer runs on
the thread that ran the step; an error in one sequence (its streamer, its settings) ends that
sequence only, and its call raises it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.chat_prefix import system_prompt_tokens
from ..api.encoding import PromptEncoder
from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..api.inputs import Prompt
from ..api.perf_metrics import CallTimer
from ..errors import UsageError
from ..runtime.paged.runner import PagedRunner
from ..runtime.paged.scheduler import Scheduler
from ..runtime.runner import Runner
from .assisted_lane import AssistedLane
from .beam_search import check_beam_request
from .logits_process import LogitsConstraint
from .speculative import Assisted
from .token_loops import BatchTimes, Outcome, TokenLoops

REENTERED = (
    "LLMPipeline is already generating on this thread (called from its streamer?); "
    "a streamer may not call into its own pipeline"
)


@dataclass
class SequenceRequest:
    """One sequence to generate: a prompt's ids, its config, which sample of the prompt it is
    (its random generator), its constraint and streamer, and the prompt's tokens to keep cached
    at a chat system prompt's priority.  With ``num_beams`` > 1: the prompt's beam search."""

    ids: np.ndarray
    config: GenerationConfig
    sample: int = 0
    constraint: LogitsConstraint | None = None
    streamer: Any = None
    held: int = 0


def requests(
    encoder: PromptEncoder,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    config: GenerationConfig,
    streamer: Any,
    history: list[dict[str, str]] | None,
    timer: CallTimer,
    make_constraint: Callable[[], LogitsConstraint | None] | None,
) -> list[SequenceRequest]:
    """Each prompt's ``num_return_sequences`` sequences (or its beam search), through the
    chat ``history`` when one is given; a system prompt's tokens held at a raised priority,
    as on the lone path.  ``streamer``: one for the call's one answer, or a list with one per
    answer (prompt by prompt, sample by sample)."""
    beams = config.num_beams > 1
    if beams:
        check_beam_request(config, streamer, make_constraint)
    streamers = iter(streamer) if isinstance(streamer, (list, tuple)) else None
    out = []
    for prompt in prompts:
        ids = encoder.ids(prompt, config.apply_chat_template, history, timer)
        timer.inputs += int(ids.size)
        held = 0
        if prompt.ids is None:
            messages = history if history is not None else prompt.messages
            held = system_prompt_tokens(tokenizer, messages, ids)
        for sample in range(1 if beams else config.num_return_sequences):
            constraint = make_constraint() if make_constraint is not None else None
            own = next(streamers) if streamers is not None else streamer
            out.append(SequenceRequest(ids, config, sample, constraint, own, held))
    return out


@dataclass
class Ticket:
    """One call's sequences in the session: their scheduler handles in order, the outcome of each
    that finished, its steps' times, and what to call with each new token (handle, token)."""

    handles: list[int] = field(default_factory=list)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    times: BatchTimes = field(default_factory=BatchTimes)
    on_token: Callable[[int, int], None] | None = None

    @property
    def complete(self) -> bool:
        return len(self.outcomes) == len(self.handles)

    def results(self) -> list[list[GenerationResult]]:
        """Each request's results in order (a sequence's one, a beam search's several); the
        first error raised instead."""
        out: list[list[GenerationResult]] = []
        for handle in self.handles:
            outcome = self.outcomes[handle]
            if isinstance(outcome, BaseException):
                raise outcome
            out.append(outcome if isinstance(outcome, list) else [outcome])
        return out


class RunningBatch:
    """A :class:`Scheduler` and its token loops, shared by every call on one runner."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        *,
        max_num_seqs: int,
        position_limit: int | None = None,
        fit_pools: bool = True,
        split_fuse: bool = True,
        mode: Hashable = None,
        switch: Callable[[Any], None] | None = None,
        assisted: Assisted | None = None,
        scheduler: Any = None,
    ) -> None:
        """``fit_pools``: grow the KV pools to hold the sequences that run at once (False:
        the user sized them; the scheduler preempts).  ``mode``: what the model computes with now
        (the LoRA alphas); sequences of another mode wait until the batch is empty, then
        ``switch(mode)`` sets it (nothing may be live).  ``assisted``: the pipeline's
        speculative decoding, if it has one: every request then runs in the assisted lane, one
        at a time (:mod:`.assisted_lane`).  ``scheduler``: one with the paged scheduler's
        methods over other runners (the static path's slots:
        :class:`~npuw_kv.runtime.static.slot_scheduler.SlotScheduler`)."""
        self.runner = runner
        if scheduler is None:
            assert isinstance(runner, PagedRunner), "the static path brings its own scheduler"
            scheduler = Scheduler(runner, max_num_seqs, split_fuse=split_fuse)
        self.scheduler = scheduler
        lane = (
            AssistedLane(assisted, runner, tokenizer, position_limit)
            if assisted is not None
            and assisted.mode is not None
            and isinstance(runner, PagedRunner)
            else None
        )
        self.loops = TokenLoops(self.scheduler, tokenizer, position_limit, lane)
        self.fit_pools = fit_pools
        self._cond = threading.Condition()
        self._stepper: int | None = None  # the thread running a step
        self._joining = 0  # threads waiting to add or drop sequences: they go first
        self._closed = 0  # calls that have the runner alone: new sequences wait for them
        self._owner: dict[int, Ticket] = {}
        self._sizes: dict[int, tuple[int, int]] = {}  # live handle -> (sequences, tokens)
        self.mode = mode
        self._switch = switch if switch is not None else _no_modes

    @property
    def busy(self) -> bool:
        return self.loops.running

    @property
    def requests(self) -> int:
        """Calls (a ``ContinuousBatchingPipeline`` request each) with sequences still live."""
        return len({id(ticket) for ticket in self._owner.values()})

    def add(
        self,
        requests: Sequence[SequenceRequest],
        ticket: Ticket | None = None,
        at_once: int | None = None,
        mode: Hashable = None,
    ) -> Ticket:
        """Queue ``requests`` (all of them or, on an error such as a too-long prompt, none)
        for the next step; their ticket.  The pools grow to hold these and the live requests
        at once (``at_once`` sequences of the longest's size, when given), keeping the blocks
        of the live ones.  ``mode``: the LoRA alphas the requests run with; while sequences of
        other alphas run, this waits (stepping them) until they end."""
        ticket = ticket if ticket is not None else Ticket()
        for r in requests:
            if r.config.num_beams > self.scheduler.max_num_seqs:
                raise UsageError(
                    f"num_beams={r.config.num_beams}: a beam search steps all its beams at "
                    f"once, at most max_num_seqs ({self.scheduler.max_num_seqs}) sequences; lower "
                    "num_beams or raise max_num_seqs (MAX_NUM_SEQS)"
                )
        while True:
            with self._between_steps():
                if mode == self.mode or not self.busy:
                    if mode != self.mode:
                        self._switch(mode)  # nothing is live: the model may change
                        self.mode = mode
                        self.scheduler.stats.latest = False  # its cached prefixes are gone
                    self._enqueue(requests, ticket, at_once)
                    return ticket
            # sequences of other adapters run: step them (with the other callers) to their end
            self._run_until(lambda: not self.busy or mode == self.mode)

    def _enqueue(
        self, requests: Sequence[SequenceRequest], ticket: Ticket, at_once: int | None
    ) -> None:
        """Add the requests to the scheduler (between two steps): all of them or none."""
        if not self.busy:
            self.runner.release()  # a lone run's sequence: cached, not live
        lane = self.loops.lane is not None  # each request runs alone: the pools hold one
        sizes = [(max(1, r.config.num_beams), self._tokens(r)) for r in requests]
        if self.fit_pools and requests and not lane:
            self._fit([*self._sizes.values(), *sizes], at_once)
        try:
            for r in requests:
                if lane:
                    handle = self.loops.add_assisted(
                        r.ids, r.config, r.constraint, r.streamer, ticket.times
                    )
                elif r.config.num_beams > 1:
                    handle = self.loops.add_beams(r.ids, r.config, ticket.times)
                else:
                    handle = self.loops.add(
                        r.ids, r.config, r.sample, r.constraint, r.streamer, r.held, ticket.times
                    )
                ticket.handles.append(handle)
                self._owner[handle] = ticket
                if not lane:
                    self._sizes[handle] = sizes[len(ticket.handles) - 1]
        except BaseException:
            for handle in ticket.handles:
                self._drop(handle)
            raise

    def drop(self, handles: Sequence[int]) -> None:
        """End these sequences now (stopped or cancelled); their outcomes are not recorded."""
        with self._between_steps():
            for handle in handles:
                if handle in self.loops:
                    self._drop(handle)

    def wait(self, ticket: Ticket) -> list[list[GenerationResult]]:
        """Run steps until ``ticket``'s requests are done; their results in order."""
        self._run_until(lambda: ticket.complete, ticket)
        return ticket.results()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """The runner to one call alone (speculative decoding, new pools): new requests wait
        while the live ones are run to their end, and until the call is done."""
        self._refuse_reentry()
        with self._cond:
            self._closed += 1
        try:
            self._run_until(lambda: not self.busy)
            # what the call does to the runner (a lone prompt, new pools, other adapters) is
            # newer than the batch's last prompt: kv_stats reports the runner's figures
            self.scheduler.stats.latest = False
            yield
        finally:
            with self._cond:
                self._closed -= 1
                self._cond.notify_all()

    def step(self) -> None:
        """One step, if any sequence is live (genai's ``ContinuousBatchingPipeline.step``)."""
        steps = self.loops.steps
        self._run_until(lambda: not self.busy or self.loops.steps != steps)

    # -- the protocol -------------------------------------------------------------------------
    def _refuse_reentry(self) -> None:
        if self._stepper == threading.get_ident():
            raise RuntimeError(REENTERED)

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the session between two steps (to add or drop sequences); a thread waiting
        here goes before the next step."""
        self._refuse_reentry()
        with self._cond:
            self._joining += 1
            try:
                while self._stepper is not None or self._closed:
                    self._cond.wait()
                yield
            finally:
                self._joining -= 1
                self._cond.notify_all()

    def _run_until(self, finished: Callable[[], bool], mine: Ticket | None = None) -> None:
        """Wait, or run the next step for everyone, until ``finished()``.  The thread that
        steps keeps stepping; the others sleep until a request ends (theirs, maybe), a thread
        waits to join, or the stepper leaves (then one of them steps).  A step interrupted in
        the model call (Ctrl-C: ``KeyboardInterrupt`` in the thread running it) ends the call
        of that thread (``mine``) and raises there; the other calls go on, their sequences
        read again from their tokens."""
        self._refuse_reentry()
        with self._cond:
            try:
                while not finished():
                    # joiners go first, unless a call has the runner alone (they wait for it)
                    if self._stepper is not None or (self._joining and not self._closed):
                        self._cond.wait()
                        continue
                    self._stepper = threading.get_ident()
                    self._cond.release()
                    try:
                        stepped = self.loops.step()
                    except BaseException as exc:
                        self._cond.acquire()
                        self._stepper = None
                        if mine is not None:
                            self._end_call(mine, exc)
                        raise
                    self._cond.acquire()
                    self._stepper = None
                    self._record(*stepped)
                    if stepped[1] or self._joining:
                        self._cond.notify_all()
            finally:
                self._cond.notify_all()  # another thread may step now

    def _record(self, tokens: dict[int, list[int]], done: dict[int, Outcome]) -> None:
        for handle, chosen in tokens.items():
            ticket = self._owner.get(handle)
            if ticket is not None and ticket.on_token is not None:
                for token in chosen:
                    ticket.on_token(handle, token)
        for handle, outcome in done.items():
            self._sizes.pop(handle, None)
            ticket = self._owner.pop(handle, None)
            if ticket is not None:
                ticket.outcomes[handle] = outcome
                if not isinstance(outcome, Exception) and isinstance(outcome, BaseException):
                    self._end_call(ticket, outcome)

    def _end_call(self, ticket: Ticket, interrupt: BaseException) -> None:
        """A call interrupted (its streamer raised ``KeyboardInterrupt``, or Ctrl-C came while
        its thread ran the step): its other sequences end now, their blocks given back, and no
        streamer of it hears more; the call raises ``interrupt`` in its own thread."""
        for handle in ticket.handles:
            if handle not in ticket.outcomes:
                if handle in self.loops:
                    self._drop(handle)
                ticket.outcomes[handle] = interrupt

    def _drop(self, handle: int) -> None:
        self.loops.drop(handle)
        self._owner.pop(handle, None)
        self._sizes.pop(handle, None)

    def _tokens(self, request: SequenceRequest) -> int:
        """The most tokens a request's sequences hold: its prompt and its budget."""
        size = int(request.ids.size)
        return size + (request.config.new_token_budget(size) or self.scheduler.capacity)

    def _fit(self, sizes: Sequence[tuple[int, int]], at_once: int | None) -> None:
        """Pools for the requests of ``sizes`` (sequences, tokens) at once, at most
        ``max_num_seqs`` sequences (or ``at_once``), each of the longest's tokens."""
        count = sum(n for n, _ in sizes) if at_once is None else max(at_once, len(sizes))
        longest = max(tokens for _, tokens in sizes)
        scheduler = self.scheduler
        if isinstance(self.runner, PagedRunner):  # the static path's slots are fixed
            self.runner.fit_batch(min(scheduler.max_num_seqs, count), longest, scheduler.budget)


def _no_modes(mode: Any) -> None:
    raise AssertionError(f"a batch session without modes asked for mode {mode!r}")
