"""Group beam search with openvino-genai's semantics (``sampling/sampler.cpp``,
``GroupBeamSearcher``), so that the same config gives genai's sequences and scores.

* ``num_beams`` beams in ``num_beam_groups`` groups of ``group_size``; each step every beam
  proposes its ``2 * group_size`` most likely tokens (log-softmax of the raw logits, float32 as
  genai: no temperature, penalties or ``min_new_tokens`` mask, which genai's beam search does
  not apply either), minus ``diversity_penalty`` per earlier group's child that took the same
  token this step, with ``no_repeat_ngram_size`` banning n-gram repeats over prompt + beam.
* A group's candidates are ranked by cumulative log-prob; a stop token (or a stop string)
  among the best ``group_size`` finishes a hypothesis, scored ``sum / len ** length_penalty``
  (the stop token counted), kept if among the group's best ``group_size`` finished ones; the
  first ``group_size`` other candidates become the group's next beams.
* A group is done per ``stop_criteria`` (EARLY: as soon as it holds ``group_size`` finished;
  HEURISTIC: when no running beam can beat the worst finished at its current length; NEVER:
  at ``max_new_tokens`` when ``length_penalty`` > 0); at ``max_new_tokens`` every running beam
  is finished (``length``).  The results are all groups' finished hypotheses, best first by
  score, ``num_return_sequences`` of them.

The beams run as sequences of the paged path's scheduler (:class:`BeamJob`), beside other
requests; their KV is shared between them by the block manager's fork.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.config_checks import limit
from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..errors import UsageError
from ..runtime.paged.scheduler import Scheduler
from .logits_process import banned_ngram_ends
from .stopping import StopStrings

_F32 = np.float32


@dataclass
class Beam:
    """A running beam: its cache sequence, tokens and per-token log-probs (as scored)."""

    seq: int  # its sequence of the scheduler
    tokens: list[int]
    logprobs: list[np.float32]
    score: np.float32  # cumulative log-prob, float32 as genai sums it


@dataclass
class Candidate:
    parent: Beam
    token: int
    logprob: np.float32
    score: np.float32


@dataclass
class Hypothesis:
    """A finished sequence; ``rank`` orders it inside its group (genai's heap score)."""

    tokens: list[int]  # without the stop token
    logprobs: list[np.float32]  # the stop token's included
    rank: np.float32
    finish: str


@dataclass
class Group:
    beams: list[Beam]
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False


def _per_length(score: np.float32, length: float, penalty: float) -> np.float32:
    """``score / length ** penalty`` in float32 (0/0 is NaN, as in genai's C++)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _F32(score) / np.power(_F32(length), _F32(penalty))


def log_softmax32(logits: np.ndarray) -> np.ndarray:
    """genai's log-softmax: float32, the exponentials summed in order."""
    x = np.asarray(logits, _F32).reshape(-1)
    top = x.max()
    total = np.cumsum(np.exp(x - top), dtype=_F32)[-1]
    return (x - top - np.log(total)).astype(_F32)


class GroupBeamSearch:
    """The beams, groups and finished hypotheses of one prompt."""

    def __init__(
        self,
        config: GenerationConfig,
        prompt: list[int],
        root: int,
        budget: int | None,
        stops: StopStrings,
    ) -> None:
        self.config = config
        self.prompt = prompt
        self.budget = budget
        self.stops = stops
        self.stop_ids = config.stop_ids()
        self.size = config.num_beams // config.num_beam_groups
        # every group starts from the prompt; only its first beam counts (the others, at
        # -inf, keep the group from proposing the same token twice)
        self.groups = [
            Group(
                [
                    Beam(root, [], [], _F32(0.0) if i == 0 else _F32(-np.inf))
                    for i in range(self.size)
                ]
            )
            for _ in range(config.num_beam_groups)
        ]

    @property
    def running(self) -> list[Beam]:
        return [b for g in self.groups if not g.done for b in g.beams]

    def select(self, rows: dict[int, np.ndarray]) -> None:
        """One step: ``rows`` maps each running beam's sequence to its logits row."""
        cfg, size = self.config, self.size
        children: dict[int, list[Candidate]] = {}
        for g, group in enumerate(self.groups):
            if group.done:
                continue
            candidates: list[Candidate] = []
            for beam in group.beams:
                logp = log_softmax32(rows[beam.seq])
                for earlier in range(g):
                    for kid in children.get(earlier, []):
                        logp[kid.token] -= _F32(cfg.diversity_penalty)
                n = limit(cfg.no_repeat_ngram_size)
                history = self.prompt + beam.tokens
                if n is not None and len(history) > 1 and len(history) >= n:
                    logp[banned_ngram_ends(history, n)] = -np.inf
                best = np.argsort(-logp, kind="stable")[: 2 * size]
                candidates += [
                    Candidate(beam, int(t), logp[t], _F32(beam.score + logp[t])) for t in best
                ]
            candidates.sort(key=lambda c: -c.score)
            kids: list[Candidate] = []
            for i, cand in enumerate(candidates):
                if cand.token in self.stop_ids:
                    if i < size:
                        self._finish(group, cand, "stop", stop_token=True)
                    continue
                if self.stops.stops and self.stops.hit([*cand.parent.tokens, cand.token]):
                    if i < size:
                        self._finish(group, cand, "stop", stop_token=False)
                    continue
                kids.append(cand)
                if len(kids) == size:
                    break
            children[g] = kids
            self._check_done(group)
            if not kids:
                group.done = True
            if group.done:
                group.beams = []
        for g, group in enumerate(self.groups):
            if not group.done:
                group.beams = [
                    Beam(
                        c.parent.seq,
                        [*c.parent.tokens, c.token],
                        [*c.parent.logprobs, c.logprob],
                        c.score,
                    )
                    for c in children[g]
                ]

    def _finish(self, group: Group, cand: Candidate, reason: str, stop_token: bool) -> None:
        """Keep ``cand`` (the parent and its token) as finished if among the group's best."""
        parent = cand.parent
        length = len(parent.tokens) + (1 if stop_token else 0)
        tokens = parent.tokens if stop_token else [*parent.tokens, cand.token]
        hyp = Hypothesis(
            list(tokens),
            [*parent.logprobs, cand.logprob],
            _per_length(cand.score, length, self.config.length_penalty),
            reason,
        )
        self._keep(group, hyp)

    def _keep(self, group: Group, hyp: Hypothesis) -> None:
        group.finished.append(hyp)
        if len(group.finished) > self.size:
            worst = min(range(len(group.finished)), key=lambda i: group.finished[i].rank)
            del group.finished[worst]

    def _check_done(self, group: Group) -> None:
        """genai's ``is_done``: judged on the best beam of the previous step."""
        if len(group.finished) < self.size:
            return
        criteria, penalty = self.config.stop_criteria.name.lower(), self.config.length_penalty
        best = group.beams[0]
        worst = min(h.rank for h in group.finished)
        if criteria == "early":
            group.done = True
            return
        length = len(best.tokens)
        if criteria == "never" and penalty > 0:
            length = self.budget if self.budget is not None else 2**64 - 1
        group.done = bool(worst >= _per_length(best.score, length, penalty))

    def finalize(self) -> None:
        """``max_new_tokens`` (or the cache) reached: every running beam is finished."""
        for group in self.groups:
            if not group.done:
                for beam in group.beams:
                    rank = _per_length(beam.score, len(beam.tokens), self.config.length_penalty)
                    self._keep(group, Hypothesis(beam.tokens, beam.logprobs, rank, "length"))
                group.done = True
                group.beams = []

    def results(self) -> list[Hypothesis]:
        """Every group's finished hypotheses, best score first, as many as asked for."""
        every = [h for g in self.groups for h in g.finished]
        every.sort(key=lambda h: -self.score(h))
        return every[: self.config.num_return_sequences]

    def score(self, hyp: Hypothesis) -> float:
        """genai's ``get_beam_search_score``: the sum of the sequence's log-probs (the stop
        token's included) over its length to the ``length_penalty``."""
        total = _F32(0.0)
        for logprob in hyp.logprobs:
            total = _F32(total + logprob)
        return float(_per_length(total, len(hyp.logprobs), self.config.length_penalty))


class BeamJob:
    """One prompt's beam search driven by a scheduler's steps, beside other requests: the
    prompt is prefilled once, then each step runs every live beam, one subsequence each.  A
    beam that parts from another is the scheduler's fork of it (full blocks shared, the rest
    copied); a beam with no child ends, its full blocks staying cached."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        ids: np.ndarray,
        config: GenerationConfig,
        position_limit: int | None = None,
    ) -> None:
        self.scheduler, self.ids = scheduler, ids
        self.stops = StopStrings(tokenizer, config.stop_strings, config.include_stop_str_in_output)
        self.budget = config.new_token_budget(int(ids.size))
        capacity = scheduler.capacity
        self.room = min(capacity, position_limit or capacity) - int(ids.size)
        prompt = [int(t) for t in ids.reshape(-1)]
        self.root = scheduler.submit(prompt)
        self.search = GroupBeamSearch(config, prompt, self.root, self.budget, self.stops)
        self.live: set[int] = {self.root}  # scheduler handles of the beams being run
        self.rows: dict[int, np.ndarray] = {}
        self.steps = 0  # beam steps, as genai counts generated tokens for beam search
        self.start = time.perf_counter()
        self.ttft = 0.0
        self.first_logits: np.ndarray | None = None
        self.peak_blocks = self.copied_bytes = 0

    def take(self, handle: int, logits: np.ndarray) -> list[GenerationResult] | None:
        """A beam's logits; once every live beam has its own, one search step: the results
        if the search is over (its beams ended), else None (the next beams fed)."""
        self.rows[handle] = logits
        if len(self.rows) < len(self.live):
            return None
        if self.first_logits is None:
            self.first_logits, self.ttft = logits, time.perf_counter() - self.start
        self.steps += 1
        self.search.select(self.rows)
        self.rows = {}
        beams = self.search.running
        generated = len(beams[0].tokens) if beams else 0
        if beams and (self.budget is None or generated < self.budget) and generated < self.room:
            self._advance(beams)
            return None
        if beams:
            self.search.finalize()
        self.close()
        return self._results()

    def _advance(self, beams: list[Beam]) -> None:
        """Fork the parents with several children, end those with none, feed each beam."""
        scheduler = self.scheduler
        moved = scheduler.moved_bytes
        handles: list[int] = []
        for beam in beams:  # every fork before any feed: a child copies its parent as it was
            handles.append(beam.seq if beam.seq not in handles else scheduler.fork(beam.seq))
        self.copied_bytes += scheduler.moved_bytes - moved
        for handle in self.live - set(handles):
            scheduler.finish(handle)
        self.live = set(handles)  # before feeding: should a feed fail, close() ends these
        for beam, handle in zip(beams, handles, strict=True):
            beam.seq = handle
            scheduler.feed(handle, beam.tokens[-1])
        self.peak_blocks = max(self.peak_blocks, scheduler.distinct_blocks(handles))

    def cut_short(self) -> list[GenerationResult]:
        """The search ended where it is (the pools cannot hold its beams): its best
        hypotheses so far, as when it reaches its budget."""
        if self.search.running and self.steps:
            self.search.finalize()
        self.close()
        return self._results()

    def close(self) -> None:
        """End every beam still live (finished, or the request was dropped)."""
        for handle in self.live:
            if handle in self.scheduler.live:
                self.scheduler.finish(handle)
        self.live = set()

    def _results(self) -> list[GenerationResult]:
        decode_s = time.perf_counter() - self.start - self.ttft
        return hypothesis_results(
            self.search, self.stops, int(self.ids.size), self.ttft, decode_s, self.first_logits
        )


def hypothesis_results(
    search: GroupBeamSearch,
    stops: StopStrings,
    prompt_tokens: int,
    ttft: float,
    decode_s: float,
    first_logits: np.ndarray | None,
) -> list[GenerationResult]:
    """The search's finished hypotheses as results, best first, each cut at its stop string."""
    results = []
    for hyp in search.results():
        text, kept = stops.cut(hyp.tokens)
        results.append(
            GenerationResult(
                hyp.tokens[:kept],
                text,
                hyp.finish,
                prompt_tokens,
                ttft,
                decode_s,
                first_logits,
                [float(p) for p in hyp.logprobs[:kept]],
                [],
                search.score(hyp),
            )
        )
    return results


def check_beam_request(config: GenerationConfig, streamer: Any, constraint: Any) -> None:
    """What beam search refuses, as genai does, before any work."""
    if streamer is not None:  # as genai: its streamer takes greedy / sampled tokens only
        raise UsageError(f"a streamer cannot follow beam search (num_beams={config.num_beams})")
    if constraint is not None:
        raise UsageError("structured output is not supported with num_beams > 1")
