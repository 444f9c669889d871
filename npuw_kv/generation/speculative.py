"""Prompt-lookup and speculative decoding: several tokens checked in one main-model call.

A *candidate source* (:mod:`~npuw_kv.generation.candidates`) guesses the next tokens:
:class:`PromptLookup` copies what followed the latest earlier occurrence of the text's last
n-gram (prompt + answer),
:class:`DraftProposer` lets a small draft model run ahead greedily, or grows a tree of its
likeliest continuations (tree search, :mod:`~npuw_kv.generation.draft_tree`).
:class:`SpeculativeRunner` feeds the main model the token just chosen *and* the candidates in
one chunk over the shared KV cache (``Runner.verify``; a tree with its mask), which returns the
logits after each of them.

The generation loop (:mod:`npuw_kv.generation.decode`) is not changed: it still samples one token
at a time.  When the token it chose is the next candidate, the logits after that candidate are
already computed and :meth:`SpeculativeRunner.step` returns them without running the model (in
a tree: a child of the node taken last); at the first other token the rejected candidates' KV
is dropped (``Runner.truncate``; accepted tree nodes cached out of place are fed again) and the
next round starts.  So every token is chosen from the logits plain decoding would compute
(up to the rounding of a K + 1-row chunk against a one-row step: in exact f32 greedy output is
plain greedy's token for token, and sampling draws what plain sampling draws), while stop
strings, EOS, budgets, penalties, structured output and the streamer see one token at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.perf_metrics import PerfMetrics
from ..api.speculative_metrics import ModelCalls, SDPerfMetrics, SDPerModelsPerfMetrics
from ..errors import UsageError
from ..runtime.runner import SPECULATIVE_PATH, CacheInfo, ChunkHook, Runner
from .candidates import CandidateSource, DraftProposer, PromptLookup
from .draft import DraftModel, build_draft, resolve_draft
from .draft_tree import CandidateTree, in_place

DEFAULT_ASSISTANT_TOKENS = 5  # genai's when a draft model is given and neither field is set
# with assistant_confidence_threshold the draft stops at its first unsure token, or here
MAX_THRESHOLD_CANDIDATES = 16
SETTINGS = ("prompt_lookup", "draft_model")  # LLMPipeline(...) settings consumed here


@dataclass
class SpeculativeStats:
    """What the last generate call's speculation did (``kv_stats()["speculative"]``)."""

    mode: str  # "prompt_lookup" or "draft_model"
    verify_calls: int = 0  # main-model calls after the prompt (each checks 0..K candidates)
    candidates: int = 0  # candidate tokens proposed and checked
    accepted: int = 0  # of them, chosen by the sampler (no main-model call of their own)
    draft_calls: int = 0  # draft-model calls (prompt included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.candidates if self.candidates else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate}


class SpeculativeRunner(Runner):
    """A runner for :func:`npuw_kv.generation.decode.generate_tokens` whose steps are verified in
    chunks.

    ``step(token)`` returns the stored logits when ``token`` is the next candidate; otherwise
    it drops the rejected candidates and runs ``token`` with the next candidates in one call.
    Everything else (capacity, stats) is the wrapped runner's, less the unconsumed rows: each
    part of the :class:`Runner` contract is forwarded by name below.
    """

    def __init__(
        self,
        runner: Runner,
        source: CandidateSource,
        num_candidates: int,
        budget: Callable[[int], int | None],
        stats: SpeculativeStats,
        tree: tuple[int, int] | None = None,
    ) -> None:
        """``tree``: (depth, branching) of the draft's candidate tree; None: a chain."""
        self._runner = runner
        self.source = source
        self.num_candidates = num_candidates
        self._budget = budget  # prompt length -> new-token budget (None: none)
        self.counts = stats
        self.tree_shape = tree
        self.history: list[int] = []
        self._prompt = 0
        # the candidates of the last call, their logits, and the nodes accepted so far
        self._tree = CandidateTree((), ())
        self._rows = np.empty((0, 0), np.float32)
        self._path: list[int] = []
        self._base = 0  # history tokens before the tree (its node i is cached at base + i)
        self.main_calls = ModelCalls()  # each main-model call: its time, the tokens it gave

    def prefill(self, ids: np.ndarray, on_chunk: ChunkHook | None = None) -> np.ndarray:
        return self._start(self._runner.prefill, ids, on_chunk)

    def prefill_every_row(self, ids: np.ndarray, on_rows: ChunkHook) -> np.ndarray:
        return self._start(self._runner.prefill_every_row, ids, on_rows)

    def _start(self, prefill: Callable[..., np.ndarray], ids: np.ndarray, hook: Any) -> np.ndarray:
        self.main_calls = ModelCalls()
        logits = self.main_calls.run(prefill, ids, hook)
        self.history = [int(t) for t in np.asarray(ids).reshape(-1)]
        self._prompt = len(self.history)
        self._drop_tree()
        self.source.start(self.history)
        return logits

    def step(self, token: int) -> np.ndarray:
        token = int(token)
        at = self._path[-1] if self._path else -1
        child = self._tree.child(at, token)
        if child is not None:
            self.history.append(token)
            self._path.append(child)
            self.counts.accepted += 1
            self.main_calls.took_another()
            return self._rows[child]
        # the sampler left the tree: keep the KV of what it accepted in place, feed the rest
        cached = self._in_place()
        self._drop_tree()
        self._runner.truncate(cached)
        self.history.append(token)
        fed = self.history[cached:]
        tree = self._candidates(len(fed))
        chain = tree.is_chain
        parents = None if chain else [*range(-1, len(fed) - 1), *self._offset(tree, len(fed))]
        rows = self.main_calls.run(self._runner.verify, [*fed, *tree.tokens], parents)
        self.counts.verify_calls += 1
        self.counts.candidates += len(tree)
        self._tree, self._rows, self._base = tree, rows[len(fed) :], len(self.history)
        return rows[len(fed) - 1]

    @staticmethod
    def _offset(tree: CandidateTree, fed: int) -> list[int]:
        """The tree's parents within a call that first feeds ``fed`` tokens (its root the
        last of them)."""
        return [fed - 1 if p < 0 else fed + p for p in tree.parents]

    def _in_place(self) -> int:
        """History tokens whose KV the main model holds where plain decoding would."""
        if not len(self._tree):
            return len(self.history)
        return self._base + in_place(self._path)

    def _drop_tree(self) -> None:
        self._tree, self._path = CandidateTree((), ()), []

    def _candidates(self, fed: int) -> CandidateTree:
        """At most as many as can still be used: within the budget (the last token of an
        answer is never fed), the KV cache and one chunk, after the ``fed`` tokens the call
        feeds first."""
        budget = self._budget(self._prompt)
        k = min(self.num_candidates, self._runner.remaining_capacity - fed, self.chunk - fed)
        depth = k
        if budget is not None:
            depth = min(k, budget - (len(self.history) - self._prompt) - 1)
        if k <= 0 or depth <= 0:
            return CandidateTree((), ())
        if self.tree_shape is not None and isinstance(self.source, DraftProposer):
            deepest, branching = self.tree_shape
            return self.source.propose_tree(self.history, min(deepest, depth), branching, k)
        return CandidateTree.chain(self.source.propose(self.history, depth)[:depth])

    def finish(self) -> None:
        """Drop the candidates the answer did not use, so the cache holds what plain decoding
        leaves (the prompt and every answer token but the last, less accepted tree nodes
        cached out of place) and nothing else."""
        if len(self._tree):
            cached = self._in_place()
            self._drop_tree()
            self._runner.truncate(min(cached, len(self.history)))
        if isinstance(self.source, DraftProposer):
            self.counts.draft_calls = self.source.calls

    @property
    def tokens_in_cache(self) -> int:
        """The sequence's tokens the cache holds or will hold when they are fed (accepted tree
        nodes cached out of place are fed again), less unused candidates."""
        return min(self._runner.tokens_in_cache, len(self.history))

    @property
    def remaining_capacity(self) -> int:
        return self._runner.remaining_capacity + self._runner.tokens_in_cache - self.tokens_in_cache

    # -- the rest of the Runner contract: the wrapped runner's ----------------------------------
    @property
    def cache(self) -> CacheInfo:  # type: ignore[override]
        return self._runner.cache

    @property
    def chunk(self) -> int:  # type: ignore[override]
        return self._runner.chunk

    @property
    def max_prompt_len(self) -> int:  # type: ignore[override]
        return self._runner.max_prompt_len

    @property
    def takes_trees(self) -> bool:  # type: ignore[override]
        return self._runner.takes_trees

    @property
    def kv_binding(self) -> str:  # type: ignore[override]
        return self._runner.kv_binding

    @property
    def reused_tokens(self) -> int:  # type: ignore[override]
        return self._runner.reused_tokens

    @property
    def prefill_copied_bytes(self) -> int:  # type: ignore[override]
        return self._runner.prefill_copied_bytes

    @property
    def switch_copied_bytes(self) -> int:  # type: ignore[override]
        return self._runner.switch_copied_bytes

    @property
    def cached_tokens(self) -> int:
        return self._runner.cached_tokens

    @property
    def shared_weights(self) -> bool:
        return self._runner.shared_weights

    @property
    def host_bytes_copied(self) -> int:
        return self._runner.host_bytes_copied

    def verify(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        return self._runner.verify(tokens, parents)

    def truncate(self, length: int) -> None:
        self._runner.truncate(length)

    def hold_prefix(self, tokens: int) -> None:
        self._runner.hold_prefix(tokens)

    def forget_prefixes(self) -> None:
        self._runner.forget_prefixes()

    def stats(self) -> dict[str, Any]:
        return self._runner.stats()


# -- settings -------------------------------------------------------------------------------
def assisted_fields(config: GenerationConfig) -> list[str]:
    """The assisted-generation fields ``config`` sets (empty: plain decoding)."""
    return [
        name
        for name, unset in (
            ("num_assistant_tokens", (None, 0)),
            ("max_ngram_size", (0,)),
            ("assistant_confidence_threshold", (0.0,)),
            ("tree_depth", (0,)),
        )
        if getattr(config, name) not in unset
    ]


def check_config(config: GenerationConfig, mode: str | None) -> None:
    """Refuse, by name, what the pipeline's mode (None, "prompt_lookup", "draft_model")
    cannot honour in ``config``."""
    given = assisted_fields(config)
    if config.branching_factor != 1 and not config.tree_depth:
        warnings.warn(
            f"branching_factor={config.branching_factor} has no effect without tree_depth > 0 "
            "(tree search)",
            RuntimeWarning,
            stacklevel=4,
        )
    if mode is None:
        if given:  # as genai: speculation changes no token, so without it the call decodes
            warnings.warn(
                f"{given[0]}={getattr(config, given[0])!r} has no effect: the pipeline has "
                "neither a draft model nor prompt_lookup=True, so it decodes one token per "
                "step (as openvino_genai does)",
                RuntimeWarning,
                stacklevel=4,
            )
        return
    for name in ("num_return_sequences", "num_beams"):  # as genai: one sequence verified
        if getattr(config, name) > 1:
            raise UsageError(
                f"{name}={getattr(config, name)} is not compatible with {mode} (one sequence "
                "is verified at a time)"
            )
    if config.tree_depth and mode != "draft_model":
        raise UsageError(
            f"tree_depth={config.tree_depth} (tree search) grows its tree with a draft model: "
            "build the pipeline with draft_model=, or set tree_depth=0"
        )
    if mode == "prompt_lookup":
        if not config.num_assistant_tokens or not config.max_ngram_size:
            raise UsageError(
                "prompt_lookup=True needs num_assistant_tokens and max_ngram_size > 0 in the "
                "generation config"
            )
        if config.assistant_confidence_threshold:
            raise UsageError(
                "assistant_confidence_threshold needs a draft model (draft_model=), not "
                "prompt_lookup"
            )
        return
    if config.max_ngram_size:
        raise UsageError(
            f"max_ngram_size={config.max_ngram_size} is for prompt_lookup=True, not draft_model"
        )
    if config.assistant_confidence_threshold and config.num_assistant_tokens:
        raise UsageError(
            "num_assistant_tokens and assistant_confidence_threshold are mutually exclusive "
            "(as in openvino_genai): set one of them"
        )


def candidates_per_step(config: GenerationConfig) -> tuple[int, float]:
    """(candidates per main-model call, the draft's confidence threshold)."""
    threshold = float(config.assistant_confidence_threshold)
    if threshold > 0:
        return MAX_THRESHOLD_CANDIDATES, threshold
    return int(config.num_assistant_tokens or DEFAULT_ASSISTANT_TOKENS), 0.0


Plan = tuple[str | None, DraftModel | None]  # (mode, the draft to load)


def take_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Pop ``prompt_lookup`` / ``draft_model`` from ``LLMPipeline``'s settings."""
    return {k: settings.pop(k) for k in SETTINGS if k in settings}


def plan(given: Mapping[str, Any], config: Any) -> Plan:
    """Check the settings before anything is compiled: the mode and the draft to load."""
    lookup, draft = given.get("prompt_lookup", False), given.get("draft_model")
    if not isinstance(lookup, (bool, np.bool_)):
        raise UsageError(f"prompt_lookup must be True or False, got {lookup!r}")
    if lookup and draft is not None:
        raise UsageError("prompt_lookup=True and draft_model= are exclusive: give one")
    mode = "prompt_lookup" if lookup else "draft_model" if draft is not None else None
    if mode is not None and not config.paged:
        raise UsageError(f"{mode}: {SPECULATIVE_PATH}")
    return mode, resolve_draft(draft) if draft is not None else None


class Assisted:
    """A pipeline's assisted generation: none, prompt lookup or a draft model.  It checks each
    call's generation config and wraps the runner for the calls that speculate."""

    def __init__(
        self, mode: str | None = None, draft: Runner | None = None, main: Runner | None = None
    ) -> None:
        """``main``: the pipeline's runner (whether it checks trees)."""
        self.mode = mode
        self.draft = draft
        # the model that cannot check a tree of candidates in one call (None: both can)
        self._no_trees: str | None = None
        if draft is not None:
            lacking = [
                n
                for n, r in (("the model", main), ("the draft model", draft))
                if r is None or not r.takes_trees
            ]
            self._no_trees = lacking[0] if lacking else None
        self.last: SpeculativeStats | None = None
        self._current: SpeculativeRunner | None = None
        self._done: list[SpeculativeRunner] = []  # this call's prompts (extended metrics)

    @classmethod
    def build(cls, plan: Plan, pipe: Any, settings: Mapping[str, Any]) -> Assisted:
        """From :func:`plan` (``pipe``: the pipeline, built; ``settings``: what it was given,
        which the draft inherits)."""
        mode, draft = plan
        if draft is None:
            return cls(mode)
        runner, vocab = build_draft(draft, pipe.config.device, settings)
        if vocab != pipe.vocab_size:
            raise UsageError(
                f"draft_model has a vocabulary of {vocab} tokens, the model {pipe.vocab_size}: "
                "the draft must share the main model's tokenizer"
            )
        return cls(mode, runner, pipe.runner)

    def check(self, config: GenerationConfig) -> None:
        """Refuse what ``config`` asks that this pipeline cannot do."""
        check_config(config, self.mode)
        if config.tree_depth and self._no_trees is not None:
            raise UsageError(
                f"tree_depth > 0 (tree search): {self._no_trees}'s paged form takes no tree "
                "mask (its linear-attention layers would run the branches as one sequence): "
                "set tree_depth=0"
            )

    def start(self) -> None:
        """A generate call starts: the extended metrics are its own."""
        self._done = []

    def runner(self, runner: Runner, config: GenerationConfig) -> Runner:
        """``runner``, wrapped for this call when the pipeline speculates."""
        self._current = None
        if self.mode is None:
            return runner
        count, threshold = candidates_per_step(config)
        source: CandidateSource
        if self.draft is None:
            source = PromptLookup(config.max_ngram_size)
        else:
            source = DraftProposer(self.draft, threshold)
        self.last = SpeculativeStats(self.mode)
        tree = (config.tree_depth, config.branching_factor) if config.tree_depth else None
        self._current = SpeculativeRunner(
            runner, source, count, config.new_token_budget, self.last, tree
        )
        return self._current

    def finish(self) -> None:
        if self._current is not None:
            self._current.finish()
            self._done.append(self._current)
            self._current = None

    def extended_metrics(self, metrics: PerfMetrics) -> SDPerModelsPerfMetrics | None:
        """genai's ``extended_perf_metrics`` for the call that ``metrics`` measured: the
        main and draft models' calls and the candidates' counts with a draft model; None
        otherwise (genai's prompt lookup returns None too)."""
        done, self._done = self._done, []
        if self.draft is None or not done:
            return None
        main = SDPerfMetrics.of([r.main_calls for r in done], metrics.load_time, 0)
        drafts = [cast(DraftProposer, r.source).timing for r in done]
        draft = SDPerfMetrics.of(drafts, metrics.load_time, 0)
        accepted = sum(r.counts.accepted for r in done)
        return SDPerModelsPerfMetrics(
            metrics, main, draft, accepted, sum(r.counts.candidates for r in done)
        )

    def stats(self) -> dict[str, Any]:
        return {"speculative": self.last.as_dict()} if self.last is not None else {}
