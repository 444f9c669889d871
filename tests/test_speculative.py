"""Prompt-lookup and speculative decoding (npuw_kv/generation/speculative.py) on SmolLM2, exact f32.

The main model checks the chosen token and K candidates in one PagedAttention call; a token
the sampler takes from those rows costs no call of its own.  So the answer must be plain
decoding's token for token, with fewer main-model calls than tokens when candidates are good,
and the KV cache must hold afterwards exactly what plain decoding leaves.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import CHUNK, MAX_PROMPT, MIN_RESPONSE, make_pipe, make_tiny_gguf

import npuw_kv
from npuw_kv import LLMPipeline
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.model.source import resolve_model

SETTINGS = dict(
    prefill_chunk_size=CHUNK,
    max_prompt_len=MAX_PROMPT,
    min_response_len=MIN_RESPONSE,
    attention_backend="pa",
    kv_precision="f32",
    **EXACT_F32,
)
CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
)
LOOKUP = {"num_assistant_tokens": 5, "max_ngram_size": 3}


@pytest.fixture(scope="module")
def plain(smol_dir):
    return make_pipe(smol_dir, "CPU", attention_backend="pa", kv_precision="f32")


@pytest.fixture(scope="module")
def lookup(smol_dir):
    return LLMPipeline(smol_dir, "CPU", prompt_lookup=True, **SETTINGS)


@pytest.fixture(scope="module")
def good_draft(smol_dir):
    """The unchanged speculative_decoding_lm.py sample's draft: genai's own object."""
    draft = openvino_genai.draft_model(str(smol_dir), "CPU")
    return LLMPipeline(smol_dir, "CPU", draft_model=draft, **SETTINGS)


@pytest.fixture(scope="module")
def bad_draft(smol_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary: its guesses are mostly wrong."""
    root = tmp_path_factory.mktemp("draft")
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=5, dtype="Q8_0")
    tiny = resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)
    return LLMPipeline(smol_dir, "CPU", draft_model=npuw_kv.draft_model(tiny, "CPU"), **SETTINGS)


@pytest.fixture(scope="module")
def code_ids(plain):
    return plain.encode("Repeat this code exactly:\n" + CODE).tolist()


@pytest.fixture(scope="module")
def greedy(plain, code_ids):
    """Plain greedy answer to ``code_ids`` (40 tokens; a shorter budget gives its prefix)."""
    return plain.generate(code_ids, max_new_tokens=40, ignore_eos=True).tokens


def count_infers(pipe, monkeypatch) -> list[int]:
    """Count the main model's inferences (each prefill chunk, step or verify call)."""
    calls: list[int] = []
    infer = pipe.runner._infer

    def counted(*args, **kwargs):
        calls.append(1)
        return infer(*args, **kwargs)

    monkeypatch.setattr(pipe.runner, "_infer", counted)
    return calls


def test_prompt_lookup_gives_greedy_tokens_in_fewer_calls(greedy, lookup, code_ids, monkeypatch):
    want = greedy
    calls = count_infers(lookup, monkeypatch)
    got = lookup.generate(code_ids, max_new_tokens=40, ignore_eos=True, **LOOKUP)
    assert got.tokens == want
    stats = lookup.kv_stats()["speculative"]
    assert stats["accepted"] > 10 and stats["verify_calls"] == len(calls) - 1  # 1: prefill
    assert len(calls) - 1 < len(want) - 1  # plain decoding: one call per token after the first
    assert stats["verify_calls"] + stats["accepted"] == len(want) - 1
    assert lookup.kv_stats()["tokens_in_cache"] == len(code_ids) + len(want) - 1


@pytest.mark.parametrize("draft", ["good_draft", "bad_draft"])
def test_draft_model_gives_greedy_tokens(request, greedy, code_ids, draft):
    pipe = request.getfixturevalue(draft)
    want = greedy[:24]
    got = pipe.generate(code_ids, max_new_tokens=24, ignore_eos=True, num_assistant_tokens=4)
    assert got.tokens == want
    stats = pipe.kv_stats()["speculative"]
    if draft == "good_draft":  # the same model: every guess right, 5 tokens a call
        assert stats["acceptance_rate"] == 1.0 and stats["verify_calls"] <= 5
    else:
        assert stats["acceptance_rate"] < 0.5 and stats["candidates"] > 20
    pipe.runner.blocks.check_invariants()


def test_tree_verify_gives_each_node_its_own_path(good_draft, text_ids):
    """One call over a tree of candidates (the qq_bias mask): each node's logits are those of
    its own path run as a chain, its siblings unseen."""
    runner = good_draft.runner
    assert runner.takes_trees and good_draft.engine.assisted.draft.takes_trees
    ids = np.array(text_ids(40))
    a, b1, b2, c = text_ids(44)[40:]
    runner.prefill(ids)
    tree = runner.verify([a, b1, b2, c], [-1, 0, 0, 2])
    runner.truncate(len(ids))
    chain = runner.verify([a, b2, c])
    np.testing.assert_allclose(tree[[0, 2, 3]], chain, atol=1e-3)
    runner.truncate(len(ids))
    assert np.abs(runner.verify([a, b1, b2, c])[3] - chain[2]).max() > 0.1  # unmasked: not
    runner.blocks.check_invariants()


@pytest.mark.parametrize("draft", ["good_draft", "bad_draft"])
@pytest.mark.parametrize(("depth", "branching", "size"), [(3, 2, 6), (1, 4, 4), (4, 1, 10)])
def test_tree_search_gives_greedy_tokens(
    request, plain, greedy, code_ids, draft, depth, branching, size
):
    """Tree search (genai's ``tree_depth`` / ``branching_factor``): greedy's tokens, the cache
    left as plain decoding leaves it or shorter, never a candidate's KV (a continuation that
    reuses it gives plain decoding's tokens)."""
    pipe = request.getfixturevalue(draft)
    want = greedy[:24]
    args = {"tree_depth": depth, "branching_factor": branching, "num_assistant_tokens": size}
    got = pipe.generate(code_ids, max_new_tokens=24, ignore_eos=True, **args)
    assert got.tokens == want
    stats = pipe.kv_stats()["speculative"]
    assert stats["verify_calls"] + stats["accepted"] == 23
    if draft == "good_draft":  # the draft's first path is the answer: every call takes depth
        assert stats["verify_calls"] <= -(-23 // (depth + 1)) + 1
    pipe.runner.blocks.check_invariants()
    cached = pipe.kv_stats()["tokens_in_cache"]
    assert len(code_ids) <= cached <= len(code_ids) + 23
    follow = code_ids + got.tokens
    more = pipe.generate(follow, max_new_tokens=6, ignore_eos=True, **args).tokens
    assert more == plain.generate(follow, max_new_tokens=6, ignore_eos=True).tokens


def test_tree_search_refusals(lookup, good_draft, code_ids):
    with pytest.raises(ValueError, match="tree_depth=2 .*draft model"):
        lookup.generate(code_ids, max_new_tokens=4, tree_depth=2, **LOOKUP)
    with pytest.raises(ValueError, match="tree search .* cannot sample"):
        good_draft.generate(code_ids, max_new_tokens=4, tree_depth=2, do_sample=True)
    with pytest.raises(ValueError, match=r"num_assistant_tokens \(2\) must be >= tree_depth"):
        good_draft.generate(code_ids, max_new_tokens=4, tree_depth=3, num_assistant_tokens=2)
    with pytest.warns(RuntimeWarning, match="branching_factor=3 has no effect"):
        good_draft.generate(code_ids, max_new_tokens=2, branching_factor=3)
    assert len(good_draft.generate(code_ids, max_new_tokens=3).tokens) == 3  # still usable


def test_draft_confidence_threshold(greedy, good_draft, code_ids):
    want = greedy[:16]
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 16, True
    config.assistant_confidence_threshold = 0.4
    assert good_draft.generate(code_ids, config).tokens == want
    assert good_draft.kv_stats()["speculative"]["accepted"] > 0


@pytest.fixture(scope="module")
def genai_draft(smol_dir):
    """openvino-genai's own speculative pipeline, exact f32, the same model as its draft."""
    exact = dict(KV_CACHE_PRECISION="f32", **EXACT_F32)
    draft = openvino_genai.draft_model(str(smol_dir), "CPU", **exact)
    return openvino_genai.LLMPipeline(str(smol_dir), "CPU", draft_model=draft, **exact)


def test_draft_model_extended_perf_metrics(good_draft, genai_draft, code_ids, monkeypatch):
    """``extended_perf_metrics`` as genai's ``SDPerModelsPerfMetrics``: main model calls,
    draft calls and accepted candidates as the speculative loop counted them; each main
    call gives the answer tokens genai's gives (1 + its accepted candidates)."""
    tensor = ov.Tensor(np.array([code_ids], np.int64))
    args = {"max_new_tokens": 24, "ignore_eos": True, "num_assistant_tokens": 4}
    calls = count_infers(good_draft, monkeypatch)
    result = good_draft.generate(tensor, **args)
    stats = good_draft.kv_stats()["speculative"]
    ext = result.extended_perf_metrics
    main, draft = ext.main_model_metrics, ext.draft_model_metrics
    assert len(result.tokens[0]) == 24
    assert ext.get_num_accepted_tokens() == stats["accepted"] > 10
    assert ext.get_num_draft_tokens() == stats["candidates"]
    assert ext.get_num_rejected_tokens() == stats["candidates"] - stats["accepted"]
    assert ext.get_draft_acceptance_rate() == stats["acceptance_rate"]
    sizes = list(main.raw_metrics.m_batch_sizes)
    assert len(main.raw_metrics.m_durations) == len(sizes) == len(calls)  # prefill + verifies
    assert len(sizes) == stats["verify_calls"] + 1
    assert main.get_num_generated_tokens() == sum(sizes) == 24
    assert sum(sizes) - len(sizes) == stats["accepted"]  # per call: 1 + accepted candidates
    theirs = genai_draft.generate(tensor, **args).extended_perf_metrics.main_model_metrics
    assert sizes == list(theirs.raw_metrics.m_batch_sizes)  # [1, 5, 5, 5, 5, 3]
    assert len(draft.raw_metrics.m_durations) == stats["draft_calls"]
    assert ext.get_num_draft_processed_tokens() == draft.get_num_generated_tokens()
    assert draft.get_num_generated_tokens() >= stats["candidates"]
    # the call's own metrics, and genai's formulas over the main model's call durations (µs)
    assert ext.get_num_generated_tokens() == result.perf_metrics.get_num_generated_tokens()
    assert ext.get_ttft() == result.perf_metrics.get_ttft()
    us = list(main.raw_metrics.m_durations)
    assert main.get_ttft().mean == pytest.approx(us[0] / 1000)
    assert main.get_ttst().mean == pytest.approx(us[1] / 1000)
    assert main.get_latency().mean == pytest.approx(np.mean(us[2:]) / 1000)
    per_token = np.array(us[2:]) / np.array(sizes[2:]) / 1000
    assert tuple(main.get_tpot()) == pytest.approx((per_token.mean(), per_token.std()))
    assert main.get_throughput().mean == pytest.approx(1000 / per_token.mean())
    assert main.get_inference_duration().mean == pytest.approx(sum(us) / 1000)
    assert 0 < main.get_inference_duration().mean < result.perf_metrics.get_generate_duration().mean
    ratio = draft.get_inference_duration().mean / main.get_inference_duration().mean
    assert ext.get_draft_to_main_inference_duration_ratio() == pytest.approx(ratio)
    for cls, ours in (("SDPerModelsPerfMetrics", ext), ("SDPerfMetrics", main)):
        names = dir(getattr(openvino_genai.py_openvino_genai, cls))
        assert not [n for n in names if not n.startswith("_") and not hasattr(ours, n)]


def test_extended_perf_metrics_of_a_batch_and_summed(good_draft, lookup, code_ids):
    """A batch's prompts each count (per-prompt TTFT/TTST); ``+`` / ``+=`` add calls as
    genai's; prompt lookup returns None there, as genai's does."""
    prompts = ["Repeat: a b c a b c a b c", "Count from one to ten."]
    batch = good_draft.generate(prompts, max_new_tokens=10, ignore_eos=True)
    ext = batch.extended_perf_metrics
    main = ext.main_model_metrics
    assert main.get_num_generated_tokens() == 20 == ext.get_num_generated_tokens()
    assert len(main.raw_metrics.m_times_to_first_token) == 2 == len(main.segments)
    assert main.get_ttst().std > 0  # two prompts' second calls
    one = good_draft.generate(prompts[:1], max_new_tokens=6, ignore_eos=True)
    total = ext + one.extended_perf_metrics
    assert total.get_num_accepted_tokens() == (
        ext.get_num_accepted_tokens() + one.extended_perf_metrics.get_num_accepted_tokens()
    )
    assert total.main_model_metrics.get_num_generated_tokens() == 26
    ext += one.extended_perf_metrics
    assert ext.main_model_metrics.segments == total.main_model_metrics.segments
    assert lookup.generate([CODE], max_new_tokens=4, **LOOKUP).extended_perf_metrics is None


def test_unchanged_sample_contract(plain, lookup, smol_dir):
    """prompt_lookup_decoding_lm.py: a text prompt and genai's GenerationConfig, streamed."""
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 30
    config.num_assistant_tokens = 5
    config.max_ngram_size = 3
    prompt = "Repeat this code exactly:\n" + CODE
    pieces: list[str] = []
    text = lookup.generate(prompt, config, pieces.append)
    assert text == plain.generate(prompt, max_new_tokens=30) == "".join(pieces)
    assert lookup.kv_stats()["speculative"]["accepted"] > 0
    with pytest.raises(ValueError, match="num_assistant_tokens and max_ngram_size"):
        lookup.generate(prompt, max_new_tokens=4)  # as genai: prompt lookup needs both


def test_genai_draft_made_before_npuw_kv_is_read_from_the_files_it_maps(smol_dir, monkeypatch):
    """genai's draft_model returns an opaque OVAny (a C++ ModelDesc: no path readable);
    npuw_kv records what the ones made after its import were made from, and reads one made
    before from the model directory genai keeps mapped for it, when that is the only one."""
    from npuw_kv.api.genai_objects import mapped_model_dirs
    from npuw_kv.generation import draft

    made_unrecorded = openvino_genai.draft_model.__wrapped__(str(smol_dir), "CPU")
    assert smol_dir.resolve() in [d.resolve() for d in mapped_model_dirs()]
    monkeypatch.setattr(draft, "mapped_model_dirs", lambda: [smol_dir])
    with pytest.warns(RuntimeWarning, match="read from .* the main model's device"):
        assert draft.resolve_draft(made_unrecorded).path == smol_dir
    monkeypatch.setattr(draft, "mapped_model_dirs", lambda: [smol_dir, smol_dir.parent])
    with pytest.raises(ValueError, match="cannot be read.* 2 model directories are mapped"):
        LLMPipeline(smol_dir, "CPU", draft_model=made_unrecorded, **SETTINGS)


def test_kv_after_speculation_serves_a_continuation(plain, lookup, code_ids, greedy):
    """A prompt that continues the speculated one (prompt + answer + more) reuses its blocks
    and gives the tokens of a pipeline that never speculated: no rejected candidate's KV is
    left behind."""
    answer = lookup.generate(code_ids, max_new_tokens=40, ignore_eos=True, **LOOKUP).tokens
    assert answer == greedy
    lookup.runner.blocks.check_invariants()
    more = plain.encode("\nNow write div.", template=False).tolist()
    follow = code_ids + answer + more
    got = lookup.generate(follow, max_new_tokens=12, ignore_eos=True, **LOOKUP)
    assert lookup.runner.reused_tokens > len(code_ids)  # the answer's blocks too
    assert got.tokens == plain.generate(follow, max_new_tokens=12, ignore_eos=True).tokens


def test_truncate_forgets_rejected_blocks(lookup, plain, text_ids):
    """Candidates verified across a block boundary, then rejected: the block they filled is
    not reusable, and the next tokens' logits are a fresh run's."""
    runner = lookup.runner
    ids = np.array(text_ids(40))
    runner.prefill(ids)
    junk = list(range(1000, 1040))  # fills block 1 (tokens 32..63) with rejected tokens
    runner.verify(junk[:CHUNK])
    assert runner.blocks.lookup([*ids, *junk, 0]).hit_tokens == 64
    runner.truncate(len(ids))
    assert runner.blocks.lookup([*ids, *junk, 0]).hit_tokens == 32  # the prompt's full block
    runner.blocks.check_invariants()
    follow = text_ids(60)[40:]
    rows = runner.verify(follow)
    fresh = plain.runner.prefill(np.array(text_ids(60)))
    np.testing.assert_allclose(rows[-1], fresh, atol=1e-3)


def test_stops_and_budget_inside_accepted_runs(plain, lookup, code_ids):
    """A stop string or the budget inside a run of accepted candidates ends the answer as
    plain decoding does, and the cache keeps only what plain decoding leaves."""
    for settings in ({"stop_strings": {"a * b"}}, {"max_new_tokens": 15}):
        args = {"max_new_tokens": 40, "ignore_eos": True, **settings}
        want = plain.generate(code_ids, **args)
        pieces: list[str] = []
        got = lookup.generate(code_ids, streamer=pieces.append, **args, **LOOKUP)
        assert (got.tokens, got.text, got.finish_reason) == (
            want.tokens,
            want.text,
            want.finish_reason,
        )
        assert "".join(pieces) == want.text
        assert lookup.kv_stats()["tokens_in_cache"] == plain.kv_stats()["tokens_in_cache"]
        stats = lookup.kv_stats()["speculative"]
        assert stats["accepted"] >= 3


def test_sampling_draws_what_plain_sampling_draws(plain, lookup, code_ids):
    """Each token is drawn from the main model's own logits row, one draw per token: with a
    seed the answer is plain sampling's."""
    args = {"max_new_tokens": 24, "ignore_eos": True, "do_sample": True, "rng_seed": 7}
    args |= {"temperature": 0.7}
    assert (
        lookup.generate(code_ids, **args, **LOOKUP).tokens
        == plain.generate(code_ids, **args).tokens
    )


def test_static_path_refuses_by_name(smol_dir, code_ids):
    with pytest.raises(ValueError, match="prompt_lookup: .*PagedAttention"):
        LLMPipeline(smol_dir, "CPU", prompt_lookup=True, attention_backend="sdpa")
    with pytest.raises(ValueError, match="draft_model: .*PagedAttention"):
        LLMPipeline(smol_dir, "NPU", draft_model=npuw_kv.draft_model(smol_dir))
    static = make_pipe(smol_dir, "CPU", attention_backend="sdpa")
    plain = static.generate(code_ids, max_new_tokens=3, ignore_eos=True).tokens
    assert len(plain) == 3
    # as genai: without an assistant the fields change nothing (said, not refused)
    with pytest.warns(RuntimeWarning, match="num_assistant_tokens=5 has no effect"):
        assisted = static.generate(code_ids, max_new_tokens=3, ignore_eos=True, **LOOKUP)
    assert assisted.tokens == plain


@pytest.mark.parametrize("windows", [[None, None], [8, None]])
def test_block_manager_truncate(windows):
    """``KVBlockManager.truncate``: blocks past the end are freed, a block no longer full
    leaves the reuse tree, every invariant holds (full and sliding-window groups), and
    cutting into a block another sequence shares is refused untouched."""
    from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, uniform_layers

    config = BlockManagerConfig(
        layers=uniform_layers(windows, 2, 16),
        max_seq_len=64,
        primary_blocks={w or 64: 40 for w in windows},
        tokens_per_block=4,
        max_tokens_per_call=16,
    )
    manager = KVBlockManager(config, copy_slots=lambda *args: None)
    prompt, junk = list(range(10)), [100, 101, 102, 103, 104, 105]
    manager.add_sequence("a", prompt)
    manager.add_tokens("a", junk)  # 16 tokens: block 2 (8..11) holds rejected ones
    manager.truncate("a", 11)
    manager.check_invariants()
    assert manager.num_tokens("a") == 11 and len(manager.block_table("a", 64)) == 3
    manager.add_tokens("a", [7] * 5)
    manager.remove_sequence("a")
    manager.check_invariants()
    assert manager.lookup([*prompt, *junk, 0]).hit_tokens == 8  # never the rejected block
    assert manager.lookup([*prompt, 100, *[7] * 5, 0]).hit_tokens == 16
    manager.add_sequence("b", [*prompt, 100, *[7] * 5, 9])  # claims the cached blocks
    manager.add_sequence("c", [*prompt, 100, *[7] * 5, 9])
    if windows[0] is None:  # full attention: b's and c's hit blocks are shared
        with pytest.raises(ValueError, match="detached or shared"):
            manager.truncate("b", 10)
    manager.truncate("c", 17)
    manager.check_invariants()
    if windows[0] is not None:  # the window moved past blocks an earlier token still reads
        for token in range(12):
            manager.add_token("c", token)
        with pytest.raises(ValueError, match="already released blocks token 17 reads"):
            manager.truncate("c", 17)
        manager.truncate("c", 28)
        manager.check_invariants()


def test_threads_take_turns_on_a_speculative_pipeline(plain, lookup, code_ids):
    """Speculative decoding runs one sequence alone: calls from several threads wait their turn
    (the batch is closed to them meanwhile) and each gets plain decoding's tokens."""
    import threading

    want = plain.generate(code_ids, max_new_tokens=12, ignore_eos=True).tokens
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            result = lookup.generate(code_ids, max_new_tokens=12 + i, ignore_eos=True, **LOOKUP)
            got.append(result.tokens[:12])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert got == [want] * 4
