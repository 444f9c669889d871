"""LoRA adapters: the tokens of the model with the adapter merged, on every path, switched per
call without recompiling; bad adapters refused by name.

The adapters are random low-rank matrices for a tiny optimum-intel Llama, written as PEFT
saves them (models/make_lora_adapter.py); the reference merges ``alpha * B @ A`` into the
weights and runs openvino-genai on that IR at exact f32.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import shared_tiny_ir

import npuw_kv
from npuw_kv import Adapter, AdapterConfig, LLMPipeline
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.errors import NumericError
from npuw_kv.model.lora import structural_names, weight_matmuls
from npuw_kv.model.safetensors import read_safetensors
from npuw_kv.model.source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_lora_adapter import make_lora_adapter, merge_lora, write_safetensors  # noqa: E402
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

NEW = 16
PATHS = {
    "CPU/pa": ("CPU", {"attention_backend": "pa", "kv_precision": "f32", **EXACT_F32}),
    "CPU/sdpa": ("CPU", {"attention_backend": "sdpa", **EXACT_F32}),
    "NPU": ("NPU", dict(EXACT_F32)),
}
PROMPT = np.random.default_rng(0).integers(100, 1000, 40)


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> dict[str, object]:
    """The tiny IR, two adapters (all seven projections at rank 4; q and down at rank 2) and
    genai's exact f32 tokens for the base model and for merged combinations."""
    root = tmp_path_factory.mktemp("lora")
    ir = shared_tiny_ir(tmp_path_factory, root / "ir", std=0.2, seed=3)
    first = make_lora_adapter(ir, root / "first.safetensors", rank=4, std=0.3, seed=1)
    second = make_lora_adapter(
        ir, root / "second.safetensors", rank=2, std=0.3, seed=2, targets=("q_proj", "down_proj")
    )

    def reference(directory: Path) -> list[int]:
        pipe = openvino_genai.LLMPipeline(
            str(directory), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32
        )
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos = NEW, True
        return [int(t) for t in pipe.generate(ov.Tensor(PROMPT[None]), config).tokens[0]]

    merged = {
        "base": reference(ir),
        "first": reference(merge_lora(ir, [(first, 0.75)], root / "m1")),
        "both": reference(merge_lora(ir, [(first, 0.5), (second, -1.5)], root / "m2")),
    }
    assert len(set(merged["base"])) > 3  # a varied answer
    assert merged["base"] != merged["first"] != merged["both"]  # each adapter changes the answer
    return {"ir": ir, "first": first, "second": second, "tokens": merged, "root": root}


def _run(pipe: LLMPipeline, **kwargs: object) -> list[int]:
    return list(pipe.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, **kwargs).tokens)


@pytest.mark.parametrize("path", list(PATHS))
def test_each_call_gets_the_merged_models_tokens_without_recompiling(lora, path, monkeypatch):
    device, extra = PATHS[path]
    first, second = Adapter(lora["first"]), Adapter(lora["second"])
    pipe = LLMPipeline(
        lora["ir"], device, max_prompt_len=128, adapters=AdapterConfig(first, 0.75), **extra
    )
    want = lora["tokens"]
    assert _run(pipe) == want["first"]  # the constructor's config applies by default

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a LoRA switch compiled a model")

    monkeypatch.setattr(ov.Core, "compile_model", refuse)
    assert _run(pipe, adapters=AdapterConfig()) == want["base"]  # none: the base model
    assert _run(pipe, adapters=AdapterConfig(first, 0.0)) == want["base"]  # alpha 0
    # the same prompt again: KV cached under other alphas is never reused
    assert _run(pipe, adapters=AdapterConfig(first, 0.75)) == want["first"]
    # second was not registered: refused, and the pipeline goes on as it was
    with pytest.raises(ValueError, match="not registered at construction"):
        _run(pipe, adapters=AdapterConfig(second, 1.0))
    assert _run(pipe) == want["first"]


def test_two_adapters_blend_with_their_alphas(lora):
    first, second = Adapter(lora["first"]), Adapter(lora["second"])
    both = AdapterConfig([(first, 0.5), (second, -1.5)])
    pipe = LLMPipeline(lora["ir"], "CPU", kv_precision="f32", adapters=both, **EXACT_F32)
    assert _run(pipe) == lora["tokens"]["both"]
    assert _run(pipe, adapters=AdapterConfig(first, 0.75)) == lora["tokens"]["first"]
    config = pipe.get_generation_config()
    assert config.adapters is both  # genai's default: the constructor's adapters
    both.set_alpha(second, 0.0).set_alpha(first, 0.75)
    assert _run(pipe, adapters=both) == lora["tokens"]["first"]


def test_genai_runs_our_adapter_file_to_the_same_tokens(lora):
    """The file is one genai reads, with the same meaning of alpha."""
    adapter = openvino_genai.Adapter(str(lora["first"]))
    pipe = openvino_genai.LLMPipeline(
        str(lora["ir"]),
        "CPU",
        adapters=openvino_genai.AdapterConfig(adapter, 0.75),
        KV_CACHE_PRECISION="f32",
        **EXACT_F32,
    )
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = NEW, True
    got = [int(t) for t in pipe.generate(ov.Tensor(PROMPT[None]), config).tokens[0]]
    assert got == lora["tokens"]["first"]


def test_genai_adapters_are_read_again_from_their_files(lora):
    """genai's own Adapter / AdapterConfig (opaque: npuw_kv records each Adapter's file when
    it is made), at construction and in a call, with their alphas."""
    theirs = openvino_genai.AdapterConfig(openvino_genai.Adapter(str(lora["first"])), 0.75)
    pipe = LLMPipeline(lora["ir"], "CPU", kv_precision="f32", adapters=theirs, **EXACT_F32)
    assert _run(pipe) == lora["tokens"]["first"]
    assert _run(pipe, adapters=openvino_genai.AdapterConfig()) == lora["tokens"]["base"]
    assert _run(pipe, adapters=theirs) == lora["tokens"]["first"]
    assert npuw_kv.GenerationConfig(adapters=theirs).adapters.get_adapters_and_alphas()[0][1] == (
        pytest.approx(0.75)
    )


@pytest.mark.parametrize("device", ["CPU", "NPU"])
def test_threads_with_different_adapters_each_get_their_own_tokens(lora, device):
    """Calls of other alphas wait for the running batch to end (the paged path's, or the NPU
    path's slots, every one of which then drops the KV of its last prompt: with chunks of 16
    the same prompt would otherwise continue from KV of the other alphas)."""
    first = Adapter(lora["first"])
    npu = {"prefill_chunk_size": 16, "max_prompt_len": 64, "min_response_len": NEW}
    pipe = LLMPipeline(
        lora["ir"],
        device,
        kv_precision="f32",
        adapters=AdapterConfig(first, 0.75),
        **EXACT_F32,
        **(npu if device == "NPU" else {}),
    )
    plans = [AdapterConfig(first, 0.75), AdapterConfig()] * 4
    got: dict[int, list[int]] = {}

    def call(i: int) -> None:
        got[i] = _run(pipe, adapters=plans[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(plans)):
        assert got[i] == lora["tokens"]["first" if i % 2 == 0 else "base"], i


def test_continuous_batching_requests_choose_their_adapters(lora):
    first = Adapter(lora["first"])
    pipe = npuw_kv.ContinuousBatchingPipeline(
        str(lora["ir"]),
        openvino_genai.SchedulerConfig(),
        "CPU",
        {
            "adapters": AdapterConfig(first, 0.75),
            "attention_backend": "pa",
            "kv_precision": "f32",
            **EXACT_F32,
        },
    )
    configs = []
    for adapters in (AdapterConfig(), AdapterConfig(first, 0.75)):
        config = npuw_kv.GenerationConfig(max_new_tokens=NEW, ignore_eos=True, adapters=adapters)
        configs.append(config)
    results = pipe.generate([ov.Tensor(PROMPT[None])] * 2, configs)
    assert [list(r.m_generation_ids[0]) for r in results] == [
        lora["tokens"]["base"],
        lora["tokens"]["first"],
    ]


def test_bad_adapters_are_refused_naming_the_adapter_and_the_layer(lora, tmp_path):
    with pytest.raises(ValueError, match=r"missing\.safetensors.*cannot be read"):
        Adapter(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="not a safetensors file"):
        Adapter(tmp_path / "junk.safetensors")
    first = Adapter(lora["first"])
    with pytest.raises(ValueError, match=r"first\.safetensors.*alpha must be a finite number"):
        AdapterConfig(first, float("nan"))
    # an adapter for a wider model: the layer named, nothing compiled
    layer = "model.layers.1.mlp.up_proj"
    wide = tmp_path / "wide.safetensors"
    write_safetensors(
        wide,
        {
            f"base_model.model.{layer}.lora_A.weight": np.zeros((4, 96)),
            f"base_model.model.{layer}.lora_B.weight": np.zeros((128, 4)),
        },
    )
    with pytest.raises(ValueError, match=rf"wide\.safetensors.*{layer}.*do not fit"):
        LLMPipeline(lora["ir"], "CPU", adapters=AdapterConfig(Adapter(wide)))
    lone = tmp_path / "lone.safetensors"
    write_safetensors(lone, {f"base_model.model.{layer}.lora_A.weight": np.zeros((4, 64))})
    with pytest.raises(ValueError, match=rf"lone\.safetensors.*{layer}.*no lora_B"):
        Adapter(lone)
    absent = tmp_path / "absent.safetensors"
    write_safetensors(
        absent,
        {
            "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": np.zeros((4, 64)),
            "base_model.model.model.layers.7.mlp.up_proj.lora_B.weight": np.zeros((128, 4)),
        },
    )
    with pytest.raises(
        ValueError, match=r"absent\.safetensors.*layers\.7\.mlp\.up_proj.*no MatMul"
    ):
        LLMPipeline(lora["ir"], "CPU", adapters=AdapterConfig(Adapter(absent)))


def test_a_pipeline_without_adapters_refuses_a_call_that_asks_for_one(lora):
    pipe = LLMPipeline(lora["ir"], "CPU", kv_precision="f32", **EXACT_F32)
    with pytest.raises(ValueError, match="built without LoRA adapters"):
        _run(pipe, adapters=AdapterConfig(Adapter(lora["first"])))
    assert _run(pipe, adapters=AdapterConfig()) == lora["tokens"]["base"]


def test_a_gguf_converted_model_takes_adapters_by_the_position_of_its_layers(tmp_path):
    """The GGUF-converted IR names no layer: q/k/v/o and the MLP's three are found around each
    attention op, so a PEFT adapter for the Hugging Face model applies (the default model's
    case)."""
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    ir = resolve_model(gguf, cache_dir=tmp_path / "cache", log=lambda *a, **k: None)
    adapter = make_lora_adapter(ir, tmp_path / "a.safetensors", rank=4, std=0.3, seed=1)
    assert len(read_safetensors(adapter)) == 2 * 7 * 2  # 2 layers x 7 projections x A, B
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = NEW, True
    want = []
    for directory in (ir, merge_lora(ir, [(adapter, 0.75)], tmp_path / "merged")):
        genai = openvino_genai.LLMPipeline(
            str(directory), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32
        )
        want.append([int(t) for t in genai.generate(ov.Tensor(PROMPT[None]), config).tokens[0]])
    assert want[0] != want[1]
    first = Adapter(adapter)
    for device, extra in PATHS.values():
        pipe = LLMPipeline(
            ir, device, max_prompt_len=128, adapters=AdapterConfig(first, 0.75), **extra
        )
        assert _run(pipe) == want[1], device
        assert _run(pipe, adapters=AdapterConfig()) == want[0], device


def test_layers_found_by_position_are_the_ones_optimum_names(lora):
    """On an IR that has names, the positional finding gives the same layer for every weight."""
    model = ov.Core().read_model(Path(lora["ir"]) / "openvino_model.xml")
    weights = weight_matmuls(model)
    named = {n.get_name(): n.get_friendly_name() for n in weights}
    for node in weights:
        node.set_friendly_name("MatMul")
    found = structural_names(model, weights)
    assert len(found) == 2 * 7  # every projection of both layers; the LM head is none of them
    for node, layer in found.items():
        assert f"__module.{layer}/aten::linear/MatMul" == named[node]


def test_absurd_alphas_are_refused_or_named_when_the_logits_overflow(lora):
    """An alpha float32 cannot hold is refused at once; one it can, but which overflows the
    model's activations, fails the call with a NumericError naming the alphas first, and the
    pipeline still serves the next call."""
    first = Adapter(lora["first"])
    with pytest.raises(ValueError, match="alpha must be a finite number within float32's range"):
        AdapterConfig(first, 1e39)
    pipe = LLMPipeline(lora["ir"], "CPU", adapters=AdapterConfig(first, 0.0), **EXACT_F32)
    with pytest.raises(
        NumericError, match=r"lower the LoRA alphas \(now .*first\.safetensors: 1e\+30"
    ):
        _run(pipe, adapters=AdapterConfig(first, 1e30))
    assert _run(pipe, adapters=AdapterConfig(first, 0.75)) == lora["tokens"]["first"]
