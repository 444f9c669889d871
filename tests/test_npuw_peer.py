"""Our f16 KV against NPUW's own LLM pipeline, on the same weights and the same prompt.

NPUW cannot compile the GGUF-converted IR (test_accuracy_run.py checks that it says why), so
the comparison runs on SmolLM2 exported by optimum-intel (models/make_smollm2_optimum_ir.py),
which NPUW's LLM mode compiles.  Both sides are teacher-forced on the f32 reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from npuw_kv.cli.commands import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_smollm2_optimum_ir import make_smollm2_optimum_ir  # noqa: E402


@pytest.fixture(scope="module")
def smol_optimum_dir(tmp_path_factory) -> Path:
    return make_smollm2_optimum_ir(tmp_path_factory.mktemp("smollm2-optimum"))


@pytest.mark.slow(seconds=130)
def test_f16_kv_no_worse_than_npuw(smol_optimum_dir, tmp_path):
    out = tmp_path / "acc"
    argv = ["accuracy", "--model", str(smol_optimum_dir), "--prompt-lens", "1024"]
    argv += ["--devices", "NPU", "--modes", "f16-kv,exact", "--out", str(out)]
    assert main(argv) == 0
    results = {r["mode"]: r for r in json.loads((out / "results.json").read_text())}
    npuw, ours = results["npuw-llm (peer)"], results["f16-kv"]
    assert npuw["error"] is None, npuw["error"]  # NPUW compiles this export
    assert ours["error"] is None, ours["error"]
    assert ours["matched"] >= npuw["matched"]
    assert ours["max_abs_dlogit"] <= npuw["max_abs_dlogit"]
    assert ours["mean_kl"] <= npuw["mean_kl"]
    assert results["exact"]["max_abs_dlogit"] < 1e-3  # the export runs exact through our path


def test_npu_path_runs_unfolded_when_npuw_cannot_fold(smol_optimum_dir):
    """NPUW folds this export only with every sub-graph a function (our default); without,
    folding fails, and the pipeline says so and runs the two static models unfolded, unless
    folding was asked for explicitly."""
    import warnings

    from npuw_kv import CompileError, LLMPipeline

    settings = {"max_prompt_len": 256, "min_response_len": 16}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        folded = LLMPipeline(smol_optimum_dir, "NPU", **settings)
    assert folded.runner.requests.device_properties["NPUW_FOLD"] == "YES"
    del folded
    settings["NPUW_FUNCALL_FOR_ALL"] = "NO"
    with pytest.warns(RuntimeWarning, match="NPUW could not fold this model"):
        pipe = LLMPipeline(smol_optimum_dir, "NPU", **settings)
    assert pipe.runner.requests.device_properties["NPUW_FOLD"] == "NO"
    # each unfolded model holds the weights: no variants unless asked for
    assert len(pipe.kv_stats()["prefill_variants"]) == 1
    assert len(pipe.generate([1, 9690, 198], max_new_tokens=3, ignore_eos=True).tokens) == 3
    with pytest.raises(CompileError, match="leave NPUW_FOLD unset"):
        LLMPipeline(smol_optimum_dir, "NPU", NPUW_FOLD="YES", **settings)
