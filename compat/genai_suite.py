#!/usr/bin/env python3
"""Run openvino.genai's own Python tests against npuw-kv, offline, on SmolLM2.

A developer fetches genai's tests (not copied here), then::

    git clone --depth 1 https://github.com/openvinotoolkit/openvino.genai /tmp/genai
    python compat/genai_suite.py --suite /tmp/genai/tests/python_tests --work /tmp/genai-work

which runs the selection below with openvino-genai as it is, then under two swaps, and prints
each swap's pass count beside genai's and every test that passes with genai only:

* the class swap (``--swap class``): ``openvino_genai.LLMPipeline`` and
  ``ContinuousBatchingPipeline`` replaced by npuw-kv's before any test module imports them;
  everything else (``GenerationConfig``, results, tokenizer ...) stays genai's;
* the module swap (``--swap module``): a copy of the test tree under ``--work`` whose every
  ``openvino_genai`` import names ``npuw_kv`` (``compat/module_swap.py``), as a user's one-line
  change would: every name the tests use comes from ``npuw_kv``.

``--all`` adds ``test_sampling.py`` and ``test_continuous_batching.py`` (slow: ~11 minutes a
side for the first).  This file is also the pytest plugin of those runs (``-p genai_suite``):

* ``NPUW_KV_SUITE_PIPELINE`` says which run: ``npuw-kv`` (the class swap, made here),
  ``npuw-kv-module`` (the tree is already rewritten) or unset (genai);
* every model fixture (``utils.hugging_face.download_and_convert_model[_class]``) returns the
  local SmolLM2 IR, with optimum's ``OVModelForCausalLM`` on the same IR as the Hugging Face
  reference and SmolLM2's tokenizer rebuilt from its GGUF (no hub access);
* the KV cache is f32 for every run (``--kv f16`` keeps the suite's f16: genai's own paged
  and SDPA paths then part on this Q4_1 model within 20 tokens; ``--kv exact`` also turns the
  CPU plugin's dynamic quantization of activations off);
* tests that cannot apply to SmolLM2 are skipped with a reason starting ``N/A:``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from module_swap import swapped_tree

HERE = Path(__file__).resolve().parent
SELECTION = (
    "test_generation_config.py",
    "test_llm_pipeline.py",
    "test_structured_output.py",
    "test_parsers.py::test_custom_parser",
    "test_parsers.py::test_reset_incremental_parser",
    "test_parsers.py::test_generate_stop_reason_tool_call_from_incremental_parser",
    "test_parsers.py::test_batched_generate_returns_finish_reason_for_each_sequence",
)
SLOW_FILES = ("test_sampling.py", "test_continuous_batching.py")  # --all
SWAPPED = ("LLMPipeline", "ContinuousBatchingPipeline")  # by the class swap
PIPELINE, IR_DIR, HF_DIR, KV, DEVICE = (
    "NPUW_KV_SUITE_PIPELINE",
    "NPUW_KV_SUITE_IR",
    "NPUW_KV_SUITE_HF",
    "NPUW_KV_SUITE_KV",
    "NPUW_KV_SUITE_DEVICE",
)
# model families the selection parametrizes over that SmolLM2 cannot stand in for
LINEAR_ATTENTION = ("granitemoehybrid", "lfm2", "qwen3-next", "mamba", "zamba")
PHI3 = "optimum-intel-internal-testing/tiny-random-Phi3ForCausalLM"
NOT_APPLICABLE = {
    "test_callback_decoding_metallama": "needs meta-llama/Meta-Llama-3-8B-Instruct's output",
    "test_llm_pipeline_add_extension": "needs a custom-op library built from genai's C++",
    "test_custom_parser": "needs Phi-4-mini-reasoning's <think> output",
    "test_reset_incremental_parser": "needs Phi-4-mini-reasoning's <think> output",
}


# -- the pytest plugin ------------------------------------------------------------------------
def pytest_configure(config: Any) -> None:
    """Swap the pipeline and point the suite's model fixtures at the local model."""
    import openvino_genai

    swap = os.environ.get(PIPELINE, "")
    if swap.startswith("npuw-kv"):
        import npuw_kv

        # the class swap puts ours into genai's module; the module swap's tests import npuw_kv
        into = openvino_genai if swap == "npuw-kv" else npuw_kv
        device = os.environ.get(DEVICE, "CPU")
        for name in SWAPPED:
            ours = getattr(npuw_kv, name)  # the suite's "CPU" pipelines run elsewhere
            setattr(into, name, ours if device == "CPU" else _on_device(ours, device))
    suite = Path(str(config.rootpath))
    if str(suite) not in sys.path:
        sys.path.insert(0, str(suite))
    import utils.constants as constants
    import utils.hugging_face as hub

    default = constants.get_default_llm_properties

    def properties() -> dict[Any, Any]:
        import openvino as ov
        import openvino.properties.hint as hints

        props = default()
        kv = os.environ.get(KV, "f32")
        if kv in ("f32", "exact"):
            props[hints.kv_cache_precision] = ov.Type.f32
        if kv == "exact":  # no dynamic quantization of activations either
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        return props

    constants.get_default_llm_properties = properties
    hub.get_default_llm_properties = properties
    reference: dict[str, Any] = {}

    def local_model(model_id: str, *args: Any, **kwargs: Any) -> Any:
        from optimum.intel import OVModelForCausalLM
        from transformers import AutoTokenizer

        hf = os.environ[HF_DIR]
        if "model" not in reference:
            reference["model"] = OVModelForCausalLM.from_pretrained(
                hf, local_files_only=True, compile=False, ov_config=properties()
            )
        tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
        if "padding_side" in kwargs:
            tokenizer.padding_side = kwargs["padding_side"]
        return hub.OVConvertedModelSchema(
            model_id, reference["model"], tokenizer, Path(os.environ[IR_DIR])
        )

    def local_model_class(model_id: str, model_class: Any, *args: Any, **kwargs: Any) -> Any:
        import pytest

        if model_class.__name__ != "OVModelForCausalLM":
            pytest.skip(f"N/A: needs model class {model_class.__name__}")
        return local_model(model_id, **kwargs)

    def offline(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("genai_suite: the model hub is not used (offline)")

    hub.download_and_convert_model = local_model
    hub.download_and_convert_model_class = local_model_class
    hub.snapshot_download = hub.hf_hub_download = offline


def _on_device(pipeline: type, device: str) -> type:
    """``pipeline`` whose constructor runs on ``device`` where the suite names ``"CPU"``."""

    class OnDevice(pipeline):
        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            args = tuple(device if a == "CPU" else a for a in args)
            if kwargs.get("device") == "CPU":
                kwargs["device"] = device
            super().__init__(model, *args, **kwargs)

    return OnDevice


def not_applicable(name: str, module: str, params: dict[str, Any]) -> str | None:
    """Why a test of the selection cannot apply to SmolLM2 (None: it applies)."""
    model = str(params.get("llm_model", params.get("ov_pipe", params.get("model_id", ""))))
    if any(family in model for family in LINEAR_ATTENTION):
        return "linear-attention model family"
    if name in NOT_APPLICABLE:
        return NOT_APPLICABLE[name]
    config = params.get("generation_config")
    if isinstance(config, dict) and config.get("stop_token_ids") and not _length_limit(config):
        # written for tiny-random-Phi3, which writes that token at once; SmolLM2 never does, so
        # the reference (and genai) would generate until past the model's 8192 positions
        return "no length limit; waits for a token tiny-random-Phi3 writes and SmolLM2 does not"
    if name.startswith("test_unicode_pybind_decoding"):
        return "expects tiny-random-PhiForCausalLM to emit an unfinished UTF-8 character"
    if module.endswith("test_structured_output") and model == PHI3:
        return "the same test as the TinyLlama case once both models are SmolLM2"
    return None


def _length_limit(config: dict[str, Any]) -> bool:
    return any(config.get(key) for key in ("max_new_tokens", "max_length"))


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    import pytest

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = getattr(item, "originalname", item.name)
        module = item.module.__name__ if item.module else ""
        why = not_applicable(name, module, params)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"N/A: {why}"))


def pytest_report_header(config: Any) -> str:
    return f"genai_suite: {os.environ.get(PIPELINE, 'openvino_genai')} on {os.environ.get(IR_DIR)}"


# -- the runner --------------------------------------------------------------------------------
def model_dirs(work: Path) -> tuple[Path, Path]:
    """SmolLM2's IR as npuw-kv converts it, and a copy with what optimum and transformers
    read (config, generation config, the tokenizer rebuilt from the GGUF)."""
    from npuw_kv.model.source import resolve_model

    ir, hf = work / "smollm2_ir", work / "smollm2_hf"
    if (hf / "tokenizer.json").exists():
        return ir, hf
    sys.path.insert(0, str(HERE.parent / "models"))
    from make_tiny_optimum_ir import build_smollm2_tokenizer
    from tiny_common import smollm2_gguf_path
    from transformers import AutoConfig, GenerationConfig

    source = resolve_model(None)
    for target in (ir, hf):
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for f in source.glob("openvino_*"):
            shutil.copy(f, target / f.name)
    gguf = Path(smollm2_gguf_path())
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    config.save_pretrained(hf)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(hf)
    build_smollm2_tokenizer().save_pretrained(hf)
    return ir, hf


RUNS = {  # run name -> NPUW_KV_SUITE_PIPELINE
    "openvino-genai": "openvino-genai",
    "class swap": "npuw-kv",
    "module swap": "npuw-kv-module",
}


def run(name: str, tree: Path, work: Path, *, kv: str, files: list[str], device: str) -> Path:
    """One run of ``files`` in the test tree ``tree``; its JUnit XML."""
    ir, hf = model_dirs(work)
    pipeline = RUNS[name]
    xml = work / f"{pipeline}-{device}-kv{kv}.xml"
    env = {
        **os.environ,
        PIPELINE: pipeline,
        DEVICE: device,
        IR_DIR: str(ir),
        HF_DIR: str(hf),
        KV: kv,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "pytest", "-p", "genai_suite", "-p", "no:cacheprovider"]
    command += ["-m", "", "-q", f"--junitxml={xml}", *files]
    print(f"running genai's tests: {name} ...", flush=True)
    subprocess.run(command, cwd=tree, env=env, check=False)
    return xml


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed / failed / error / skipped, the first line of its message)."""
    out = {}
    for case in ET.parse(xml).iter("testcase"):
        key = f"{str(case.get('classname')).split('.')[-1]}::{case.get('name')}"
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().split("\n")[0][:200]
        out[key] = (state, message)
    return out


def compare(
    genai: dict[str, tuple[str, str]], ours: dict[str, tuple[str, str]], swap: str = "class swap"
) -> str:
    """Both pass counts over the applicable tests, and what passes with genai only."""
    na = {k for k, (state, message) in genai.items() if message.startswith("N/A:")}
    applicable = [k for k in genai if k not in na]

    def passed(results: dict[str, tuple[str, str]]) -> int:
        return sum(results.get(k, ("missing", ""))[0] == "passed" for k in applicable)

    lines = [
        f"{len(genai)} collected, {len(na)} not applicable, {len(applicable)} applicable",
        f"openvino-genai passes {passed(genai)}/{len(applicable)}, "
        f"npuw-kv {passed(ours)}/{len(applicable)} ({swap})",
        f"passing with openvino-genai, not with npuw-kv ({swap}):",
    ]
    for key in applicable:
        if genai[key][0] == "passed" and ours.get(key, ("missing", ""))[0] != "passed":
            lines.append(f"  {key}\n      {ours.get(key, ('missing', ''))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True, type=Path, help="genai's tests/python_tests")
    parser.add_argument("--work", type=Path, default=Path("genai-suite-work"))
    parser.add_argument(
        "--kv",
        choices=("f32", "f16", "exact"),
        default="f32",
        help="the KV precision both run with (exact: f32 and no dynamic quantization)",
    )
    parser.add_argument(
        "--device", default="CPU", help="npuw-kv's device (NPU: the static path's tests)"
    )
    parser.add_argument(
        "--swap",
        choices=("class", "module", "both"),
        default="both",
        help="how genai's tests get npuw-kv: its pipeline classes, or every import",
    )
    parser.add_argument("--all", action="store_true", help=f"add {', '.join(SLOW_FILES)}")
    parser.add_argument(
        "--files",
        default=None,
        help="comma-separated test files (or file::test ids) to run instead of the selection",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    suite, work = args.suite.resolve(), args.work.resolve()
    if not (suite / "test_llm_pipeline.py").exists():
        raise SystemExit(f"{suite} is not openvino.genai's tests/python_tests folder")
    work.mkdir(parents=True, exist_ok=True)
    chosen = [*SELECTION, *(SLOW_FILES if args.all else ())]
    files = [*(args.files.split(",") if args.files else chosen), *args.pytest_args]
    swaps = ["class swap", "module swap"] if args.swap == "both" else [f"{args.swap} swap"]
    genai = outcomes(run("openvino-genai", suite, work, kv=args.kv, files=files, device="CPU"))
    for swap in swaps:
        tree = suite
        if swap == "module swap":
            tree = work / "module-swap-tests"
            count = swapped_tree(suite, tree)
            print(f"{tree}: {count} openvino_genai imports now name npuw_kv", flush=True)
        ours = run(swap, tree, work, kv=args.kv, files=files, device=args.device)
        print(compare(genai, outcomes(ours), swap), flush=True)


if __name__ == "__main__":
    main()
