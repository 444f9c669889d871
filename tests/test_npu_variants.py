"""The NPU path's static models: pyramid prefill, generate variants, the embedding and LM head
compiled once — all reading views of the one shared buffer (tiny random Llamas, NPUW on CPU).

Exact f32 compute: a variant attends over more masked slots than another, which changes no
value, so every variant must give the reference's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import own_copies, strided_outputs_bound

from npuw_kv.config import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.shapes import shapes_for

pytestmark = pytest.mark.npu_path  # also run under the NPU rules double

C = 16
# NPUW's default partitioning cannot run these tiny graphs (see test_tiny_model.py)
NPU = {"NPUW_ONLINE_PIPELINE": "NONE", **EXACT_F32}


def _ids(n: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + seed * 13) % 49000 + 100


def test_pyramid_chunks_read_only_the_past_they_need(tiny_dir, tiny_reference):
    settings = dict(prefill_chunk_size=C, max_prompt_len=128, min_response_len=16, **NPU)
    pyramid = LLMPipeline(tiny_dir, "NPU", prefill_attention="pyramid", **settings)
    static = LLMPipeline(tiny_dir, "NPU", prefill_attention="static", **settings)
    # auto, with no generate variant at this length: two more models, where a 128-token prompt's
    # chunks read the fewest slots (see test_lean_rungs_minimise_the_slots_a_full_prompt_reads)
    lean = LLMPipeline(tiny_dir, "NPU", **settings)
    assert pyramid.kv_stats()["prefill_variants"] == [0, 16, 32, 64, 112]
    assert static.kv_stats()["prefill_variants"] == [112]
    assert lean.kv_stats()["prefill_variants"] == [16, 64, 112]

    ids = _ids(90)  # 6 chunks, the first starting at slot 0 (6 pad slots)
    tokens = pyramid.generate(ids, max_new_tokens=12, ignore_eos=True).tokens
    stats = pyramid.kv_stats()
    # chunk k starts at slot 16k and runs on the smallest past >= 16k
    assert stats["prefill_pasts_used"] == [0, 16, 32, 64, 64, 112]
    assert len(stats["prefill_chunk_ms"]) == 6 and min(stats["prefill_chunk_ms"]) > 0
    assert own_copies(stats) == 0
    assert tokens == static.generate(ids, max_new_tokens=12, ignore_eos=True).tokens
    assert static.kv_stats()["prefill_pasts_used"] == [112] * 6
    assert tokens == tiny_reference(ids, 12)
    assert lean.generate(ids, max_new_tokens=12, ignore_eos=True).tokens == tokens
    assert lean.kv_stats()["prefill_pasts_used"] == [16] * 2 + [64] * 3 + [112]

    # a continuation: its one chunk ends at slot 113, starting off the grid at 97
    longer = np.concatenate([ids, tokens, _ids(5, seed=2)])
    again = pyramid.generate(longer, max_new_tokens=6, ignore_eos=True)
    used = pyramid.kv_stats()["prefill_pasts_used"]
    assert pyramid.kv_stats()["reused_tokens"] > 0
    assert used == [112] and again.tokens == tiny_reference(longer, 6)


def test_a_variant_that_does_not_reshape_leaves_the_plain_path(
    tiny_dir, tiny_reference, monkeypatch
):
    """A smaller prefill model whose reshape fails: under ``auto`` a warning naming the setting
    and one prefill model over the whole past (the reference tokens); asked for
    (``pyramid``), an error naming it. A whole-past model that fails is an error either way."""
    from npuw_kv.errors import ModelLayoutError
    from npuw_kv.model import transforms as T

    reshape, refused = T.set_shapes, {16}

    def set_shapes(model, layout, tokens, *rest):
        if tokens == C and rest[1] in refused:  # (tokens, mask length, past, blocks)
            raise RuntimeError("this past does not fit")
        return reshape(model, layout, tokens, *rest)

    monkeypatch.setattr(T, "set_shapes", set_shapes)
    settings = dict(prefill_chunk_size=C, max_prompt_len=128, min_response_len=16, **NPU)
    with pytest.warns(RuntimeWarning, match=r"NPUW_LLM_PREFILL_ATTENTION_HINT.*past 16"):
        lean = LLMPipeline(tiny_dir, "NPU", **settings)
    assert lean.kv_stats()["prefill_variants"] == [112]  # [16, 64, 112] asked for
    ids = _ids(90)
    assert lean.generate(ids, max_new_tokens=12, ignore_eos=True).tokens == tiny_reference(ids, 12)
    assert lean.kv_stats()["prefill_pasts_used"] == [112] * 6
    with pytest.raises(ModelLayoutError, match=r"prefill_attention .*past 16.*set it 'static'"):
        LLMPipeline(tiny_dir, "NPU", prefill_attention="pyramid", **settings)
    refused.add(112)
    with pytest.raises(ModelLayoutError, match="static reshape failed"):
        LLMPipeline(tiny_dir, "NPU", prefill_attention="static", **settings)


def test_auto_ladders_hold_two_models_more_than_one_per_phase():
    """``auto``: where a generate variant is kept (from ~2k prompts), one prefill model more;
    where none is (1k), two."""
    for max_len, prefill, generate in (
        (1024, (0, 256, 768), (1151,)),
        (2048, (768, 1792), (1151, 2175)),
        (4096, (1792, 3840), (1151, 4223)),
        (512, (0, 256), (639,)),
    ):
        config = PipelineConfig.from_kwargs("NPU", max_prompt_len=max_len, prefill_chunk_size=256)
        shapes = shapes_for(config, max_len + 128)
        assert (shapes.prefill_pasts, shapes.generate_pasts) == (prefill, generate), max_len
    # a generate ladder asked for in full leaves the prefill's lean rung as it is
    config = PipelineConfig.from_kwargs("NPU", max_prompt_len=4096, generate_pyramid="YES")
    assert shapes_for(config, 4224).prefill_pasts == (1792, 3840)


def test_lean_rungs_minimise_the_slots_a_full_prompt_reads():
    """The lean rungs are the pasts whose chunks read the fewest slots in all, checked against
    every placement; at 4k / 256 one rung at 7 chunks beats half the past (8) for every prompt
    length, since each chunk below it reads one chunk less and only the 9th chunk reads more."""
    from itertools import combinations

    from npuw_kv.kv.shapes import lean_rungs

    def read(rungs, whole, chunks):  # slots the first ``chunks`` chunks read
        return sum(min(p for p in (*rungs, whole) if p >= i) for i in range(chunks))

    for whole in range(1, 16):
        for count in (1, 2):
            best = lean_rungs(whole, count)
            assert len(best) == min(count, whole) and list(best) == sorted(set(best))
            every = [read(r, whole, whole + 1) for r in combinations(range(whole), len(best))]
            assert read(best, whole, whole + 1) == min(every), (whole, count)
    assert lean_rungs(15, 1) == (7,)
    assert all(read((7,), 15, n) < read((8,), 15, n) for n in range(1, 17))


def test_accuracy_modes_shape_the_ladders_they_name():
    """`npuw-kv accuracy --modes pyramid` runs the full ladders, `no-pyramid` one model per
    phase, `exact` the defaults (the lean ladders): each gated at 1k and 4k on NPU."""
    from npuw_kv.tools.accuracy.modes import MODES

    def ladders(mode: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        config = PipelineConfig.from_kwargs("NPU", max_prompt_len=4096, **MODES[mode])
        shapes = shapes_for(config, 4224)
        return shapes.prefill_pasts, shapes.generate_pasts

    assert ladders("pyramid") == ((0, 256, 512, 1024, 2048, 3072, 3840), (1151, 2175, 4223))
    assert ladders("exact") == ((1792, 3840), (1151, 4223))
    assert ladders("no-pyramid") == ((3840,), (4223,))


def test_kv_block_edges_are_where_the_model_pasts_end():
    """With dense blocks every model's past is whole blocks: the edges are the pasts short of
    the whole buffer, the generate variants rounded up to whole chunks."""
    from dataclasses import replace

    def shapes(**settings: str) -> StaticShapes:
        config = PipelineConfig.from_kwargs("NPU", max_prompt_len=4096, **settings)
        return replace(shapes_for(config, 4224), dense_blocks=True)

    lean = shapes()
    assert (lean.prefill_pasts, lean.generate_pasts) == ((1792, 3840), (1280, 4223))
    assert lean.block_edges == (1280, 1792, 3840)
    assert lean.past_blocks(1280) == (1280,) and lean.past_blocks(1792) == (1280, 512)
    assert lean.past_blocks(4223) == (1280, 512, 2048, 383)
    full = shapes(prefill_attention="pyramid", generate_pyramid="YES")
    assert full.generate_pasts == (1280, 2304, 4223)
    assert full.block_edges == (256, 512, 1024, 1280, 2048, 2304, 3072, 3840)
    assert shapes(prefill_attention="static", generate_pyramid="NO").block_edges == (3840,)
    assert replace(lean, dense_blocks=False).block_edges == ()


def test_generate_variants_switch_without_copying(tiny_dir, tiny_reference):
    settings = dict(prefill_chunk_size=C, max_prompt_len=1536, min_response_len=16, **NPU)
    pipe = LLMPipeline(tiny_dir, "NPU", **settings)
    # room for 1024 + 16, rounded up to whole chunks (the KV buffer's first block), and all
    assert pipe.kv_stats()["generate_variants"] == [1040, 1551]
    # the KV buffer's blocks meet where the models' pasts end
    prefill = pipe.kv_stats()["prefill_variants"]
    assert pipe.runner.cache.edges == tuple(sorted({*prefill, 1040} - {0}))
    # at 4096 + 16 the full ladder has room for 1024, 2048 + 16 and all; auto keeps the first
    for setting, expected in ((None, (1039, 4111)), ("YES", (1039, 2063, 4111))):
        config = PipelineConfig.from_kwargs(
            "NPU", max_prompt_len=4096, prefill_chunk_size=C, generate_pyramid=setting
        )
        assert shapes_for(config, 4112).generate_pasts == expected

    short = _ids(40)
    assert pipe.generate(short, max_new_tokens=8, ignore_eos=True).tokens == tiny_reference(
        short, 8
    )
    assert pipe.kv_stats()["generate_past_used"] == 1040

    # 1020 prompt tokens end at slot 1024: steps write 1024.., crossing 1040 mid-answer
    ids = _ids(1020, seed=3)
    result = pipe.generate(ids, max_new_tokens=24, ignore_eos=True)
    stats = pipe.kv_stats()
    assert stats["generate_past_used"] == 1551
    assert own_copies(stats) == 0 and stats["switch_host_bytes_copied"] == 0
    assert result.tokens == tiny_reference(ids, 24)
    plain = LLMPipeline(tiny_dir, "NPU", generate_pyramid="NO", **settings)
    assert plain.kv_stats()["generate_variants"] == [1551]
    assert plain.generate(ids, max_new_tokens=24, ignore_eos=True).tokens == result.tokens


def test_embedding_and_head_compiled_once(tiny_dir):
    settings = dict(prefill_chunk_size=C, max_prompt_len=64, min_response_len=16, **NPU)
    split = LLMPipeline(tiny_dir, "NPU", **settings)
    whole = LLMPipeline(tiny_dir, "NPU", shared_head="NO", **settings)
    requests = split.runner.requests
    assert requests.embed is not None and requests.head is not None
    assert requests.embed.get_compiled_model().get_property("EXECUTION_DEVICES") == ["CPU"]
    assert whole.runner.requests.head is None
    ids = _ids(50)
    a = split.generate(ids, max_new_tokens=8, ignore_eos=True)
    b = whole.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.first_logits, b.first_logits, atol=1e-4)


class _Counted:
    """An infer request that counts its calls."""

    def __init__(self, request) -> None:
        self.request, self.calls = request, 0

    def infer(self, *args, **kwargs):
        self.calls += 1
        return self.request.infer(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.request, name)


def test_prefill_runs_the_head_only_where_logits_are_read(tiny_dir):
    """The LM head (cut out of the static models) runs once a prompt, for its last chunk,
    unless a chunk hook reads every chunk's logits."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=64, min_response_len=16, **NPU)
    runner = LLMPipeline(tiny_dir, "NPU", prefix_reuse=False, **settings).runner
    head = runner.requests.head = _Counted(runner.requests.head)
    ids = _ids(50)  # 4 chunks
    last = runner.prefill(ids)
    assert head.calls == 1
    seen: list[int] = []
    hooked = runner.prefill(ids, on_chunk=lambda positions, logits: seen.append(len(logits)))
    assert head.calls == 1 + 4 and seen == [1, 1, 1, 1]
    np.testing.assert_array_equal(last, hooked)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"NPUW_LLM_PREFILL_ATTENTION_HINT": "DYNAMIC"}, "prefill_attention"),
        ({"device": "CPU", "attention_backend": "sdpa", "optimize_v_tensors": True}, "V trans"),
        ({"device": "CPU", "prefill_attention": "static"}, "prefill_attention"),
        ({"device": "CPU", "attention_backend": "sdpa", "generate_pyramid": True}, "generate"),
        ({"device": "CPU", "attention_backend": "pa", "kv_binding": "contiguous"}, "contiguous"),
    ],
)
def test_variant_settings_refused_where_they_mean_nothing(settings, message):
    from npuw_kv.config.pipeline_config import PipelineConfig

    device = settings.pop("device", "NPU")
    with pytest.raises(ValueError, match=message):
        PipelineConfig.from_kwargs(device, **settings)


def test_variant_settings_take_npuw_names():
    from npuw_kv.config.pipeline_config import PipelineConfig

    config = PipelineConfig.from_kwargs(
        "NPU",
        NPUW_LLM_PREFILL_ATTENTION_HINT="STATIC",
        NPUW_LLM_GENERATE_PYRAMID="NO",
        NPUW_LLM_SHARED_HEAD="YES",
        NPUW_LLM_OPTIMIZE_V_TENSORS="NO",
    )
    ladders = (decide.prefill_ladder(config), decide.generate_ladder(config))
    assert ladders == ("one", "one") and config.shared_head is True
    assert config.compile_properties == {}  # ours: none of them reaches the plugin
    assert decide.prefill_ladder(PipelineConfig.from_kwargs("NPU")) == "lean"  # the default
    # the CPU's one dynamic model reads exactly the past each chunk needs: no ladder, and
    # asking for one says it changes nothing there
    with pytest.warns(RuntimeWarning, match="'pyramid' shapes the static models"):
        cpu = PipelineConfig.from_kwargs("CPU", prefill_attention="pyramid")
    assert decide.prefill_ladder(cpu) == "one"


def test_kv_blocks_give_every_model_a_dense_past(tiny_dir, tiny_reference):
    """The KV buffer is cut into blocks where the models' pasts end: under the contiguity guard
    every prefill and generate model binds its past as it is (one dense block per input, no
    staging), the switch copies nothing, and a chunk crossing an edge is staged."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=1536, min_response_len=16, **NPU)
    guarded = LLMPipeline(tiny_dir, "NPU", kv_binding="contiguous", **settings)
    runner = guarded.runner
    short, whole = runner.generate_variants
    assert (short.past, whole.past) == (1040, 1551)
    edges = runner.cache.edges
    assert 1040 in edges and runner.prefill_variants[-1].past in edges
    for model in runner.prefill_variants + runner.generate_variants:
        assert set(model.binding.past_paths.values()) == {"direct"}, model.past
        blocks = 1 + sum(e < model.past for e in edges)  # one past input per block
        names = {i.get_any_name() for i in model.request.get_compiled_model().inputs}
        layer0 = runner.layout.ports[0].input_name
        assert sum(n.startswith(layer0) for n in names) == (blocks if model.past else 1)

    ids = _ids(1000, seed=5)  # slots [8, 1008): the answer runs on the short variant
    result = guarded.generate(ids, max_new_tokens=8, ignore_eos=True)
    stats = guarded.kv_stats()
    assert stats["generate_past_used"] == 1040
    assert stats["switch_host_bytes_copied"] == 0
    assert result.tokens == tiny_reference(ids, 8)
    # copy mode stages every input of a split past, each from its own block
    copied = LLMPipeline(tiny_dir, "NPU", kv_binding="copy", **settings)
    assert copied.generate(ids, max_new_tokens=8, ignore_eos=True).tokens == result.tokens

    # a continuation whose chunks end at slot 1050, so one runs over [1034, 1050): across the
    # edge at 1040, its new rows are staged and copied into the two blocks
    pipe = LLMPipeline(tiny_dir, "NPU", **settings)
    first = pipe.generate(ids, max_new_tokens=8, ignore_eos=True)
    longer = np.concatenate([ids, first.tokens, _ids(34, seed=6)])
    again = pipe.generate(longer, max_new_tokens=6, ignore_eos=True)
    stats = pipe.kv_stats()
    assert stats["reused_tokens"] > 0 and stats["host_bytes_copied"] > 0
    assert again.tokens == tiny_reference(longer, 6)


def test_a_chunk_that_fills_a_kv_block_its_model_reads_is_staged(tiny_dir):
    """At MAX_PROMPT_LEN 2C the static prefill model's past is the KV block [0, C), and chunk 0
    writes exactly that block.  Bound as the output too, NPUW (f16 KV) computes the next calls
    wrong; the binding stages that write instead, and the tokens are copy mode's."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=2 * C, min_response_len=16, **NPU)
    settings |= {"prefill_attention": "static", "kv_precision": "f16"}
    pipe = LLMPipeline(tiny_dir, "NPU", **settings)
    assert pipe.runner.cache.edges == (C,)
    ids = _ids(2 * C - 4)  # chunk 0: slots [0, C), the whole first block
    tokens = pipe.generate(ids, max_new_tokens=8, ignore_eos=True).tokens
    binding = pipe.runner.prefill_binding
    assert binding.past_paths[pipe.runner.layout.ports[0].input_name] == "direct"
    # chunk 0's outputs staged (one per port), chunk 1's ([C, 2C): not a past) direct (staged
    # too under an NPU's rules: a strided view)
    ports = len(pipe.runner.layout.ports)
    direct = ports if strided_outputs_bound(pipe) else 0
    assert (binding.outputs_staged, binding.outputs_direct) == (2 * ports - direct, direct)
    copied = LLMPipeline(tiny_dir, "NPU", kv_binding="copy", **settings)
    assert copied.generate(ids, max_new_tokens=8, ignore_eos=True).tokens == tokens


def test_a_sliced_past_binding_does_not_stage_its_first_chunk(tiny_dir):
    """The counterpart on the CPU's one dynamic model: its prefill binds the whole buffer, not a
    one-chunk block, so chunk 0's output [0, C) is no past tensor and is written in place."""
    settings = dict(prefill_chunk_size=C, max_prompt_len=2 * C, min_response_len=16, **EXACT_F32)
    pipe = LLMPipeline(tiny_dir, "CPU", attention_backend="sdpa", **settings)
    assert pipe.runner.shared_weights and pipe.runner.prefill_past == C
    pipe.generate(_ids(2 * C - 4), max_new_tokens=4, ignore_eos=True)
    binding = pipe.runner.prefill_binding
    assert (binding.outputs_staged, binding.outputs_direct) == (
        0,
        2 * len(pipe.runner.layout.ports),
    )
    assert pipe.kv_stats()["host_bytes_copied"] == 0
