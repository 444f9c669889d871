"""compat/genai_samples.py, the harness that runs openvino.genai's text-generation samples on
npuw-kv: what it compares, and how its launcher swaps classes or a whole module (genai's
samples themselves are fetched by a developer, not here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compat"))
import genai_samples  # noqa: E402
import module_swap  # noqa: E402

pytestmark = pytest.mark.unit

SPECULATIVE = """The sky is blue because
of scattering.
MAIN MODEL
  Generate time: 5948.73 ms
  Num accepted token: 75 tokens
"""


def test_the_compared_text_leaves_out_timings_and_what_the_sample_marks():
    sample = genai_samples.SAMPLES["speculative_decoding_lm"]
    assert genai_samples.compared_text(sample, SPECULATIVE) == (
        "The sky is blue because\nof scattering."
    )
    bench = "genai version: 1.0\nOutput token size: 20\nTTFT: 152.34 ± 20.82 ms\n"
    assert genai_samples.compared_text(genai_samples.SAMPLES["benchmark_genai"], bench) == (
        "Output token size: 20"
    )
    lora = "Generate with LoRA adapter:\nadapted\nGenerate without LoRA adapter:\nplain\n"
    assert genai_samples.compared_text(genai_samples.SAMPLES["lora_greedy_causal_lm"], lora) == (
        "plain"
    )


def outcome(code: int, out: str) -> genai_samples.Outcome:
    return genai_samples.Outcome(code, 1.0, out, "Traceback\nValueError: boom\n")


def test_a_verdict_says_whether_it_ran_and_whether_it_is_genais_text():
    genai = outcome(0, "The sky\nLoad time: 1.00 ms\n")
    same = genai_samples.verdict("greedy_causal_lm", outcome(0, "The sky\n"), genai)
    assert same == "runs; = genai"
    other = genai_samples.verdict("greedy_causal_lm", outcome(0, "The sea\n"), genai)
    assert "differs" in other
    assert genai_samples.verdict("greedy_causal_lm", outcome(1, ""), genai) == (
        "fails: ValueError: boom"
    )
    sampled = genai_samples.verdict("multinomial_causal_lm", outcome(0, "x"), genai)
    assert "not compared" in sampled


def test_all_fourteen_text_samples_have_a_way_to_run():
    assert len(genai_samples.SAMPLES) == 14


PROBE = """
import openvino_genai
from openvino_genai import LLMPipeline
print(openvino_genai.__name__, LLMPipeline.__module__.split(".")[0])
"""


def launch(tmp_path: Path, run: str, precision: str, code: str) -> list[str]:
    script = tmp_path / "sample.py"
    script.write_text(module_swap.swap_imports(code)[0] if run == "module swap" else code)
    done = subprocess.run(
        [sys.executable, "-c", genai_samples.LAUNCHER, run, precision, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize(
    ("run", "names"),
    [
        ("openvino-genai", "openvino_genai openvino_genai"),
        ("class swap", "openvino_genai npuw_kv"),
        ("module swap", "npuw_kv npuw_kv"),
    ],
)
def test_the_launcher_gives_a_sample_genai_or_npuw_kv(tmp_path: Path, run: str, names: str):
    assert launch(tmp_path, run, "default", PROBE) == [names]


def test_exact_precision_reaches_what_a_sample_makes(tmp_path: Path):
    draft = "import openvino_genai\nprint(openvino_genai.draft_model('m', 'CPU').properties)\n"
    properties = launch(tmp_path, "module swap", "exact", draft)[0]  # a draft compiles nothing
    assert "'DYNAMIC_QUANTIZATION_GROUP_SIZE': '0'" in properties
    assert "'INFERENCE_PRECISION_HINT': 'f32'" in properties


def test_beam_scores_are_compared_to_four_places():
    sample = genai_samples.SAMPLES["beam_search_causal_lm"]
    ours = genai_samples.compared_text(sample, "-0.719923: The sky\n-0.5: x\n")
    assert ours == genai_samples.compared_text(sample, "-0.719925: The sky\n-0.5: x\n")
    assert ours != genai_samples.compared_text(sample, "-0.721925: The sky\n-0.5: x\n")
