"""Tree search's candidate tree (npuw_kv/generation/draft_tree.py) and its check by the
speculative runner, over stand-in models: no model is compiled.

The stand-in runner answers each token from the tokens its *cache slots* hold before it (and,
in a tree, its ancestors), so a runner that left an accepted node's KV out of place, or fed a
rejected one, would see another context and answer another token.
"""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.generation.candidates import DraftProposer
from npuw_kv.generation.draft_tree import CandidateTree, grow_tree, in_place
from npuw_kv.generation.speculative import SpeculativeRunner, SpeculativeStats
from npuw_kv.runtime.paged.tree_mask import attention_mask, depths

pytestmark = pytest.mark.unit
VOCAB = 50


def truth(context: list[int]) -> int:
    """The main model's greedy next token after ``context``."""
    return (sum(t * (i + 3) for i, t in enumerate(context)) + 7 * len(context)) % VOCAB


class StandIn:
    """A paged runner whose logits depend on the tokens in its cache slots."""

    def __init__(self, guess=None, capacity: int = 400, chunk: int = 16) -> None:
        self.guess = guess or (lambda ctx: {truth(ctx): 10.0})
        self.slots: list[int] = []
        self.capacity, self.chunk, self.max_prompt_len = capacity, chunk, capacity
        self.takes_trees = True
        self.calls: list[tuple[int, bool]] = []  # (tokens fed, as a tree)

    def _logits(self, context: list[int]) -> np.ndarray:
        row = np.zeros(VOCAB, np.float32)
        for token, value in self.guess(context).items():
            row[token] = value
        return row

    def prefill(self, ids, on_chunk=None):
        self.slots = [int(t) for t in ids]
        return self._logits(self.slots)

    def verify(self, tokens, parents=None):
        tokens = [int(t) for t in tokens]
        parents = list(range(-1, len(tokens) - 1)) if parents is None else list(parents)
        assert len(tokens) <= min(self.chunk, self.remaining_capacity)
        self.calls.append((len(tokens), parents != list(range(-1, len(tokens) - 1))))
        past = list(self.slots)
        rows = []
        for i in range(len(tokens)):
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            rows.append(self._logits(past + path[::-1]))
        self.slots += tokens
        return np.stack(rows)

    def step(self, token):
        return self.verify([token])[0]

    def truncate(self, length):
        del self.slots[length:]

    @property
    def tokens_in_cache(self):
        return len(self.slots)

    @property
    def remaining_capacity(self):
        return self.capacity - len(self.slots)


def unsure(ctx: list[int]) -> dict[int, float]:
    """A draft that ranks the right token second for a third of contexts and misses it for a
    fifth: tree search accepts along the second branch, out of its cache place."""
    right, key = truth(ctx), sum(ctx) + len(ctx)
    if key % 5 == 0:
        return {(right + 2) % VOCAB: 9.0, (right + 3) % VOCAB: 8.0}
    if key % 3 == 0:
        return {(right + 1) % VOCAB: 9.0, right: 8.5}
    return {right: 9.0, (right + 1) % VOCAB: 8.0}


def greedy(spec, prompt: list[int], n: int) -> list[int]:
    logits, out = spec.prefill(np.array(prompt)), [int(np.argmax(spec.prefill(np.array(prompt))))]
    while len(out) < n:  # as the token loop: the last token is never fed
        logits = spec.step(out[-1])
        out.append(int(np.argmax(logits)))
    spec.finish()
    return out


def plain(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(truth(prompt + out))
    return out


@pytest.mark.parametrize("shape", [(4, 2), (3, 3), (5, 1), (2, 4)])
def test_tree_search_gives_greedy_tokens_from_every_branch(shape, monkeypatch):
    from npuw_kv.generation import speculative

    depth, branching = shape
    moved: list[int] = []  # accepted nodes cached out of place, fed again

    def counted(path):
        kept = in_place(path)
        moved.append(len(path) - kept)
        return kept

    monkeypatch.setattr(speculative, "in_place", counted)
    main, draft = StandIn(), StandIn(unsure)
    stats = SpeculativeStats("draft_model")
    spec = SpeculativeRunner(
        main, DraftProposer(draft, 0.0), 8, lambda _: None, stats, tree=(depth, branching)
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    got = greedy(spec, prompt, 60)
    assert got == plain(prompt, 60)
    assert stats.accepted > 0 and stats.verify_calls + stats.accepted == 59
    assert len(prompt) <= len(main.slots) < len(prompt) + 60
    assert main.slots == (prompt + got)[: len(main.slots)]  # no candidate left behind
    assert draft.slots == (prompt + got)[: len(draft.slots)]  # its tree calls are dropped
    if branching > 1:  # the second branch was accepted, out of its cache place
        assert any(tree for _, tree in main.calls) and sum(moved) > 0
    else:  # a chain: no mask needed, every accepted node in place
        assert not any(tree for _, tree in main.calls) and sum(moved) == 0


def test_tree_beats_a_chain_with_an_unsure_draft():
    prompt = [2, 7, 1, 8, 2, 8]
    counts = {}
    for tree in (None, (4, 2)):
        stats = SpeculativeStats("draft_model")
        spec = SpeculativeRunner(
            StandIn(), DraftProposer(StandIn(unsure), 0.0), 8, lambda _: None, stats, tree
        )
        assert greedy(spec, prompt, 80) == plain(prompt, 80)
        counts[tree] = stats.verify_calls
    assert counts[(4, 2)] < counts[None]


def test_budget_and_capacity_bound_the_tree():
    main = StandIn(capacity=40)
    stats = SpeculativeStats("draft_model")
    spec = SpeculativeRunner(
        main, DraftProposer(StandIn(unsure), 0.0), 10, lambda _: 25, stats, tree=(6, 3)
    )
    prompt = list(range(10))
    got = greedy(spec, prompt, 25)
    assert got == plain(prompt, 25)
    assert max(n for n, _ in main.calls) <= main.chunk
    assert main.tokens_in_cache <= len(prompt) + 24  # never the last answer token


def fake_draft(table: dict[tuple[int, ...], dict[int, float]]):
    """Expand from a table: path (tokens after the root) -> next-token log-probabilities."""

    def expand(paths: CandidateTree) -> np.ndarray:
        rows = []
        for i in range(len(paths)):
            path, j = [], i
            while j >= 0:
                path.append(paths.tokens[j])
                j = paths.parents[j]
            row = np.full(10, -50.0)
            for token, lp in table.get(tuple(path[::-1]), {}).items():
                row[token] = lp
            rows.append(row)
        return np.stack(rows)

    return expand


def test_grow_tree_keeps_the_best_paths_depth_first():
    root = np.full(10, -50.0)
    root[[1, 2, 3]] = [np.log(0.6), np.log(0.3), np.log(0.1)]
    table = {
        (1,): {4: np.log(0.5), 5: np.log(0.5)},
        (2,): {6: np.log(0.9), 7: np.log(0.1)},
    }
    tree = grow_tree(root, fake_draft(table), depth=2, branching=2, size=5)
    # scores: 1 .6, 2 .3, 1-4 .3, 1-5 .3, 2-6 .27, 2-7 .03: the best five, the likelier first
    assert tree.tokens == (1, 4, 5, 2, 6)
    assert tree.parents == (-1, 0, 0, -1, 3)
    assert depths(tree.parents).max() + 1 == 2  # nodes on the longest path
    assert tree.child(-1, 2) == 3 and tree.child(0, 6) is None
    chain = grow_tree(root, fake_draft(table), depth=3, branching=1, size=10)
    assert chain.is_chain and chain.tokens == (1, 4, 0)  # branching 1: greedy (ties: low id)


def test_in_place_and_masks():
    assert in_place([0, 1, 2]) == 3 and in_place([0, 2, 3]) == 1 and in_place([3]) == 0
    parents = [-1, 0, 0, 2]
    mask = attention_mask(parents)
    assert mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert depths(parents).tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="parent must come before"):
        attention_mask([0])
    with pytest.raises(ValueError, match="each parent must come before"):
        CandidateTree((1, 2), (1, -1))


def test_tree_search_is_refused_before_any_work_where_a_model_takes_no_tree_mask():
    """A hybrid model's paged form has no tree mask: ``check`` (every call's, before any work)
    names the model, and a call without a tree stays allowed."""
    from npuw_kv.api.generation_config import GenerationConfig
    from npuw_kv.errors import UsageError
    from npuw_kv.generation.speculative import Assisted

    flat = StandIn()
    flat.takes_trees = False
    tree = GenerationConfig(max_new_tokens=4, tree_depth=2, num_assistant_tokens=4)
    chain = GenerationConfig(max_new_tokens=4, num_assistant_tokens=4)
    for main, draft, name in ((flat, StandIn(), "the model"), (StandIn(), flat, "the draft model")):
        assisted = Assisted("draft_model", draft, main)
        with pytest.raises(UsageError, match=f"tree_depth > 0 .*{name}'s paged form"):
            assisted.check(tree)
        assisted.check(chain)
    Assisted("draft_model", StandIn(), StandIn()).check(tree)
