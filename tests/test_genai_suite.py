"""compat/genai_suite.py, the harness that runs openvino.genai's own tests against npuw-kv.

The real suite is fetched by a developer (not in CI: no network); here a suite of the same
shape (its ``utils`` modules, a test file) checks what the plugin does to it: the pipeline classes
swapped (class swap) or the tree's imports rewritten to ``npuw_kv`` (module swap), model fixtures
pointed at the local model, the hub cut off, f32 KV, tests that cannot apply marked N/A, and the
runner's comparison of two runs.
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
import module_swap  # noqa: E402

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
    assert openvino_genai.ContinuousBatchingPipeline is npuw_kv.ContinuousBatchingPipeline


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


def genai_shaped_suite(root: Path, tests: str) -> Path:
    suite = root / "python_tests"
    (suite / "utils").mkdir(parents=True)
    for name, text in UTILS.items():
        (suite / "utils" / name).write_text(text)
    (suite / "test_llm_pipeline.py").write_text(tests)
    return suite


def run_plugin(suite: Path, pipeline: str, xml: Path) -> dict[str, tuple[str, str]]:
    env = {
        **os.environ,
        genai_suite.PIPELINE: pipeline,
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
    return genai_suite.outcomes(xml)


def test_the_plugin_swaps_redirects_and_marks_a_suite_of_genais_shape(tmp_path: Path) -> None:
    suite = genai_shaped_suite(tmp_path, TESTS)
    ours = run_plugin(suite, "npuw-kv", tmp_path / "out.xml")
    assert ours["test_llm_pipeline::test_the_pipeline_is_swapped"][0] == "passed"
    mamba = ours["test_llm_pipeline::test_families[katuni4ka/tiny-random-mamba]"]
    assert mamba[0] == "skipped" and mamba[1].startswith("N/A: linear-attention")
    assert ours["test_llm_pipeline::test_families[TinyLlama/x]"][0] == "passed"
    # the comparison counts the applicable tests and lists genai-only passes
    genai = {**ours, "test_llm_pipeline::test_the_hub_is_cut_off": ("passed", "")}
    ours["test_llm_pipeline::test_the_hub_is_cut_off"] = ("failed", "boom")
    report = genai_suite.compare(genai, ours)
    assert "5 collected, 1 not applicable, 4 applicable" in report
    assert "openvino-genai passes 4/4, npuw-kv 3/4 (class swap)" in report
    assert "test_the_hub_is_cut_off" in report and "boom" in report


@pytest.mark.parametrize(
    ("name", "params", "why"),
    [
        # the class swap replaces ContinuousBatchingPipeline too: its parametrizations apply
        ("test_x", {"pipeline_type": type("P", (), {"name": "CONTINUOUS_BATCHING"})()}, None),
        ("test_callback_decoding_metallama", {}, "Meta-Llama"),
        ("test_x", {"llm_model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}, None),
    ],
)
def test_what_cannot_apply_to_smollm2(name: str, params: dict, why: str | None) -> None:
    found = genai_suite.not_applicable(name, "test_llm_pipeline", params)
    assert (found is None) if why is None else (found is not None and why in found)


MODULE_TESTS = """
import openvino_genai
import openvino_genai as ov_genai
from openvino_genai import GenerationConfig, WhisperGenerationConfig  # a name outside text
from utils.hugging_face import imported


def test_every_import_names_npuw_kv():
    import npuw_kv
    assert openvino_genai is npuw_kv and ov_genai is npuw_kv and imported is npuw_kv
    assert GenerationConfig is npuw_kv.api.generation_config.GenerationConfig


def test_a_name_outside_text_generation_is_genais_own():
    import sys
    assert WhisperGenerationConfig is sys.modules["openvino_genai"].WhisperGenerationConfig
"""


def test_the_module_swap_rewrites_a_copy_whose_tests_get_npuw_kv(tmp_path: Path) -> None:
    suite = genai_shaped_suite(tmp_path / "original", MODULE_TESTS)
    helper = suite / "utils" / "hugging_face.py"
    helper.write_text("import openvino_genai as imported\n" + helper.read_text())
    tree = tmp_path / "swapped"
    assert module_swap.swapped_tree(suite, tree) == 4
    assert "openvino_genai import" in (suite / "test_llm_pipeline.py").read_text()  # untouched
    ours = run_plugin(tree, "npuw-kv-module", tmp_path / "out.xml")
    assert {state for state, _ in ours.values()} == {"passed"}, ours
    assert len(ours) == 2


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "swapped"),
    [
        ("import openvino_genai as ov_genai", "import npuw_kv as ov_genai"),
        ("import openvino_genai", "import npuw_kv as openvino_genai"),
        ("    import openvino_genai  # lazily", "    import npuw_kv as openvino_genai"),
        ("from openvino_genai import (", "from npuw_kv import ("),
        ("import openvino_genai_extra", "import openvino_genai_extra"),
        ("x = 'from openvino_genai import y'", "x = 'from openvino_genai import y'"),
    ],
)
def test_swap_imports_rewrites_imports_only(line: str, swapped: str) -> None:
    assert module_swap.swap_imports(line)[0] == swapped
