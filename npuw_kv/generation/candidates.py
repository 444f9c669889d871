"""Where speculative decoding's candidate tokens come from (:mod:`npuw_kv.generation.speculative`).

:class:`PromptLookup` copies what followed the latest earlier occurrence of the text's last
n-gram (prompt + answer); :class:`DraftProposer` lets a small draft model run ahead greedily
over its own KV cache.  Both answer ``propose(history, k)`` with at most k tokens; the draft
also grows a tree of them (``propose_tree``, :mod:`~npuw_kv.generation.draft_tree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..api.speculative_metrics import ModelCalls
from ..runtime.runner import Runner
from ..runtime.static.prompt_reuse import shared_prefix
from .draft_tree import CandidateTree, grow_tree
from .logits_process import log_softmax


class PromptLookup:
    """Candidates copied from the text itself: summaries, code edits and quotes repeat it."""

    def __init__(self, max_ngram_size: int) -> None:
        self.max_ngram = max_ngram_size
        self.calls = 0

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest tail n-gram (n from
        ``max_ngram_size`` down to 1); the latest, as the nearest repetition is the likeliest
        to go on."""
        ids = np.asarray(history, np.int64)
        for n in range(min(self.max_ngram, ids.size - 1), 0, -1):
            # windows starting before the tail itself, so at least one token follows a match
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []


class DraftProposer:
    """Candidates from a draft model's greedy run ahead, over its own paged KV cache.

    The draft keeps the KV of the tokens it was fed; before each proposal it drops what the
    main model rejected and catches up on the tokens it has not seen (the chosen token, and
    the last candidate when all were accepted) in one call.
    """

    def __init__(self, runner: Runner, threshold: float) -> None:
        self.runner = runner
        self.threshold = threshold
        self.fed: list[int] = []
        self.timing = ModelCalls()  # each draft call: its time and the tokens it picked

    @property
    def calls(self) -> int:
        return len(self.timing.durations)

    def start(self, prompt: Sequence[int]) -> None:
        self.timing = ModelCalls()
        self.timing.run(self.runner.prefill, np.asarray(prompt, np.int64), tokens=0)
        self.fed = list(prompt)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        logits = self._catch_up(history)
        if logits is None:
            return []
        k = min(k, self.runner.remaining_capacity + 1)  # k - 1 candidates are fed back
        out: list[int] = []
        while len(out) < k:
            token = int(np.argmax(logits))
            if self.threshold > 0 and np.exp(log_softmax(logits)[token]) < self.threshold:
                break
            out.append(token)
            if len(out) < k:
                logits = self.timing.run(self.runner.step, token)
                self.fed.append(token)
        return out

    def propose_tree(
        self, history: Sequence[int], depth: int, branching: int, size: int
    ) -> CandidateTree:
        """At most ``size`` candidates in a tree at most ``depth`` deep (``draft_tree``).  Each
        layer runs the draft once, over the paths to the nodes it grows, after ``history``'s
        KV; what those calls wrote is dropped before the next one and at the end."""
        logits = self._catch_up(history)
        if logits is None or size < 1 or depth < 1:
            return CandidateTree((), ())
        past = len(history)

        def expand(paths: CandidateTree) -> np.ndarray:
            self.runner.truncate(past)
            if len(paths) > min(self.runner.chunk, self.runner.remaining_capacity):
                raise _TooBig
            return self.timing.run(self.runner.verify, paths.tokens, paths.parents)

        # the deepest layer is never run: the longest path a layer's call feeds is depth - 1
        depth = min(depth, self.runner.remaining_capacity + 1)
        try:
            tree = grow_tree(logits, expand, depth, branching, size)
        except _TooBig:  # the draft's cache or chunk cannot hold a layer: a shallower tree
            tree = grow_tree(logits, expand, 1, branching, size)
        self.runner.truncate(past)
        return tree

    def _catch_up(self, history: Sequence[int]) -> np.ndarray | None:
        """Bring the draft's KV to ``history``; the logits after it (None: it cannot)."""
        common = shared_prefix(self.fed, np.asarray(history, np.int64))  # one left to run
        try:
            self.runner.truncate(common)
        except ValueError:  # a sliding window released a block the rollback needs
            common = 0
        missing = list(history[common:])
        if common and len(missing) <= min(self.runner.chunk, self.runner.remaining_capacity):
            logits = self.timing.run(self.runner.verify, missing)[-1]
        elif len(history) <= self.runner.max_prompt_len:
            ids = np.asarray(history, np.int64)
            logits = self.timing.run(self.runner.prefill, ids)  # prefix reuse helps
        else:
            return None
        self.fed = list(history)
        return logits


class _TooBig(Exception):
    """A layer's paths do not fit the draft's chunk or cache."""


CandidateSource = PromptLookup | DraftProposer
