"""compat/genai_suite.py, the harness that runs openvino.genai's own tests against npuw-kv.

The real suite is fetched by a developer (not in CI: no network); here a suite of the same
shape (its ``utils`` modules, a test file) checks what the plugin does to it: the pipeline class
swapped, model fixtures pointed at the local model, the hub cut off, f32 KV, tests that cannot
apply marked N/A, and the runner's comparison of two runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compat"))
import genai_suite  # noqa: E402

UTILS = {
    "__init__.py": "",
    "constants.py": "def get_default_llm_properties():\n    return {'CACHE_DIR': ''}\n",
    "hugging_face.py": (
        "from collections import namedtuple\n"
        "OVConvertedModelSchema = namedtuple('S', 'model_id opt_model hf_tokenizer models_path')\n"
        "def get_default_llm_properties():\n    return {}\n"
        "def download_and_convert_model(model_id, **kw):\n    raise AssertionError('hub')\n"
        "def download_and_convert_model_class(model_id, cls, **kw):\n    raise AssertionError\n"
        "def snapshot_download(*a, **k):\n    return 'downloaded'\n"
        "def hf_hub_download(*a, **k):\n    return 'downloaded'\n"
    ),
}
TESTS = """
import openvino as ov
import openvino.properties.hint as hints
import openvino_genai
import pytest
import utils.hugging_face as hub
from utils.constants import get_default_llm_properties


def test_the_pipeline_is_swapped():
    import npuw_kv
    assert openvino_genai.LLMPipeline is npuw_kv.LLMPipeline


def test_kv_is_f32_and_the_suites_own_properties_stay():
    props = get_default_llm_properties()
    assert props[hints.kv_cache_precision] == ov.Type.f32 and "CACHE_DIR" in props


def test_the_hub_is_cut_off():
    with pytest.raises(RuntimeError, match="offline"):
        hub.snapshot_download("some/model")


@pytest.mark.parametrize("llm_model", ["katuni4ka/tiny-random-mamba", "TinyLlama/x"])
def test_families(llm_model):
    assert "mamba" not in llm_model
"""


def test_the_plugin_swaps_redirects_and_marks_a_suite_of_genais_shape(tmp_path: Path) -> None:
    suite = tmp_path / "python_tests"
    (suite / "utils").mkdir(parents=True)
    for name, text in UTILS.items():
        (suite / "utils" / name).write_text(text)
    (suite / "test_llm_pipeline.py").write_text(TESTS)
    xml = tmp_path / "out.xml"
    env = {
        **os.environ,
        genai_suite.PIPELINE: "npuw-kv",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "compat"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "pytest", "-p", "genai_suite", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*command, "-q", f"--junitxml={xml}", "test_llm_pipeline.py"],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = genai_suite.outcomes(xml)
    assert ours["test_llm_pipeline::test_the_pipeline_is_swapped"][0] == "passed"
    mamba = ours["test_llm_pipeline::test_families[katuni4ka/tiny-random-mamba]"]
    assert mamba[0] == "skipped" and mamba[1].startswith("N/A: linear-attention")
    assert ours["test_llm_pipeline::test_families[TinyLlama/x]"][0] == "passed"
    # the comparison counts the applicable tests and lists genai-only passes
    genai = {**ours, "test_llm_pipeline::test_the_hub_is_cut_off": ("passed", "")}
    ours["test_llm_pipeline::test_the_hub_is_cut_off"] = ("failed", "boom")
    report = genai_suite.compare(genai, ours)
    assert "5 collected, 1 not applicable, 4 applicable" in report
    assert "openvino-genai passes 4/4, npuw-kv 3/4" in report
    assert "test_the_hub_is_cut_off" in report and "boom" in report


@pytest.mark.parametrize(
    ("name", "params", "why"),
    [
        ("test_x", {"pipeline_type": type("P", (), {"name": "CONTINUOUS_BATCHING"})()}, "Contin"),
        ("test_callback_decoding_metallama", {}, "Meta-Llama"),
        ("test_x", {"llm_model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}, None),
    ],
)
def test_what_cannot_apply_to_smollm2(name: str, params: dict, why: str | None) -> None:
    found = genai_suite.not_applicable(name, "test_llm_pipeline", params)
    assert (found is None) if why is None else (found is not None and why in found)
