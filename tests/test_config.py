"""Settings: NPUW aliases, rounding, validation messages."""

from __future__ import annotations

import json
import warnings

import openvino as ov
import pytest

from npuw_kv.config.decide import decide, kv_precision
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32


def test_npuw_names_set_the_same_fields():
    cfg = PipelineConfig.from_kwargs(
        "npu",
        NPUW_LLM_MAX_PROMPT_LEN=2048,
        NPUW_LLM_MIN_RESPONSE_LEN=64,
        NPUW_LLM_PREFILL_CHUNK_SIZE="512",
    )
    assert (cfg.device, cfg.max_prompt_len, cfg.min_response_len, cfg.prefill_chunk_size) == (
        "NPU",
        2048,
        64,
        512,
    )
    short = PipelineConfig.from_kwargs("CPU", MAX_PROMPT_LEN=300, MIN_RESPONSE_LEN=10)
    assert short.max_prompt_len == 512  # rounded up to a multiple of the chunk (256)
    assert short.total_len == 522


def test_device_choice_of_static_models():
    assert not PipelineConfig(device="CPU").use_static_models
    assert PipelineConfig(device="NPU").use_static_models
    assert PipelineConfig.from_kwargs("CPU", STATIC_MODELS="YES").use_static_models


def test_openvino_properties_pass_through():
    cfg = PipelineConfig.from_kwargs("NPU", INFERENCE_PRECISION_HINT="f32", NPUW_FOLD="NO")
    assert cfg.compile_properties == {"INFERENCE_PRECISION_HINT": "f32", "NPUW_FOLD": "NO"}
    low_memory = PipelineConfig.from_kwargs("CPU", snippets_mode="DISABLE")
    assert low_memory.compile_properties == {"SNIPPETS_MODE": "DISABLE"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_chunk_size": 0}, "NPUW_LLM_PREFILL_CHUNK_SIZE"),
        ({"NPUW_LLM_PREFILL_CHUNK_SIZE": -4}, "must be >= 1"),
        ({"MIN_RESPONSE_LEN": 0}, "MIN_RESPONSE_LEN"),
        ({"max_prompt_len": "many"}, "expected an integer"),
        ({"kv_precision": "int3"}, "kv_precision"),
        ({"kv_binding": "mmap"}, "kv_binding"),
        ({"static_models": "maybe"}, "YES/NO"),
        ({"max_promt_len": 5}, "unknown setting 'max_promt_len'"),
        ({"prefill_chunk_size": True}, "expected an integer"),
        ({"prefix_reuse": None}, "prefix_reuse=None"),
        ({"full_prefill_logits": "perhaps"}, "full_prefill_logits"),
        ({"npuw_devices": 123}, "NPUW_DEVICES"),
        ({"max_prompt_len": 512, "MAX_PROMPT_LEN": 256}, "set the same setting"),
    ],
)
def test_invalid_settings_name_the_knob(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig.from_kwargs("CPU", **kwargs)


def test_bf16_kv_on_npu_is_refused_with_the_alternative():
    """NPUW runs no bf16 tensors: the KV input would fail at the first infer, so refuse early."""
    with pytest.raises(ValueError, match="'bf16' is not supported on NPU.*use 'f16'"):
        PipelineConfig.from_kwargs("NPU", KV_CACHE_PRECISION="BF16")
    assert PipelineConfig.from_kwargs("CPU", kv_precision="bf16").kv_precision == "bf16"
    assert PipelineConfig.from_kwargs("NPU", kv_precision="f16").kv_precision == "f16"


def test_bf16_kv_under_f32_compute_warns_towards_f16():
    """Same memory as f16 with 3 fewer mantissa bits: allowed, but the user is told."""
    core = ov.Core()
    bf16 = PipelineConfig.from_kwargs("CPU", kv_precision="bf16", **EXACT_F32)
    with pytest.warns(RuntimeWarning, match="Use kv_precision='f16'"):
        assert kv_precision(core, bf16) == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for precision in ("f16", "f32", "auto"):
            cfg = PipelineConfig.from_kwargs("CPU", kv_precision=precision, **EXACT_F32)
            assert kv_precision(core, cfg) == ("f32" if precision == "auto" else precision)


def test_unknown_device():
    with pytest.raises(ValueError, match="unknown device 'GPU9'"):
        PipelineConfig.from_kwargs("GPU9")


def test_npu_properties_share_weights_and_keep_f32_exact():
    import openvino as ov

    from npuw_kv.runtime.device import device_properties

    core = ov.Core()

    def props(device: str, wide: bool = False, **settings: object) -> dict:
        return device_properties(
            decide(core, PipelineConfig.from_kwargs(device, **settings), wide)
        )[1]

    default, other = props("NPU"), props("NPU")
    assert default["NPUW_FOLD"] == "YES"
    assert default["NPUW_DQ"] == "YES" and props("NPU", NPUW_DQ="NO")["NPUW_DQ"] == "NO"
    # SNIPPETS_MODE is the CPU plugin's: set on the core (compile.py), never given to NPU
    assert "SNIPPETS_MODE" not in props("NPU", SNIPPETS_MODE="ENABLE")
    # one bank per pipeline: its prefill and generate models share it, other pipelines do not
    assert default["NPUW_WEIGHTS_BANK"] != other["NPUW_WEIGHTS_BANK"]
    assert "NPUW_F16IC" not in default  # NPUW's default (f16 between sub-graphs) unless f32
    exact = props("NPU", INFERENCE_PRECISION_HINT="f32")
    assert exact["NPUW_F16IC"] == "NO"
    mine = props("NPU", NPUW_FOLD="NO", INFERENCE_PRECISION_HINT="f32", NPUW_F16IC="YES")
    assert (mine["NPUW_FOLD"], mine["NPUW_F16IC"]) == ("NO", "YES")  # explicit settings win
    # a model whose activations leave the f16 range (Gemma) keeps f32 between sub-graphs,
    # unless NPUW_F16IC is given
    assert props("NPU", wide=True)["NPUW_F16IC"] == "NO"
    assert props("NPU", wide=True, NPUW_F16IC="YES")["NPUW_F16IC"] == "YES"
    cpu = props("CPU")
    assert not any(k.startswith("NPUW") for k in cpu)


def test_npu_auto_kv_is_f16_unless_npuw_tensors_stay_f32():
    """A real NPU computes in f16 (NPUW's own pipeline stores f16 KV): ``auto`` KV follows it,
    except where our settings keep NPUW's tensors f32 (the f32 hint, wide activations).  With
    NPUW's sub-models on the CPU too: joined before the upcast, f16 KV saves memory there."""
    core = ov.Core()

    def kv(devices: str = "NPU", wide: bool = False, **settings: object) -> str:
        config = PipelineConfig.from_kwargs("NPU", npuw_devices=devices, **settings)
        return kv_precision(core, config, wide)

    assert kv() == kv("NPU,CPU") == kv("NPU.0") == "f16"
    assert kv(**EXACT_F32) == "f32"
    assert kv(wide=True) == "f32"
    assert kv(**EXACT_F32, NPUW_F16IC="YES") == "f32"  # f32 asked for: exact KV
    assert kv(kv_precision="f32") == "f32"  # an explicit precision wins
    assert kv("CPU") == kv("CPU,NPU") == "f16"
    assert kv("CPU", **EXACT_F32) == kv("CPU", wide=True) == "f32"
    assert kv("CPU", kv_precision="f16") == "f16"


def test_aliases_agreeing_and_yes_no_strings_are_fine():
    cfg = PipelineConfig.from_kwargs(
        "CPU", max_prompt_len=512, MAX_PROMPT_LEN=512, full_prefill_logits="NO", prefix_reuse="YES"
    )
    assert (cfg.max_prompt_len, cfg.full_prefill_logits, cfg.prefix_reuse) == (512, False, True)


def test_kv_capacity_stays_within_the_trained_context():
    cfg = PipelineConfig.from_kwargs("CPU", max_prompt_len=1000, min_response_len=128)
    assert cfg.max_prompt_len == 1024 and cfg.requested_max_prompt_len == 1000
    assert cfg.kv_capacity(None) == 1152
    assert cfg.kv_capacity((8192, "GGUF")) == 1152
    longer = PipelineConfig.from_kwargs("CPU", max_prompt_len=1024, min_response_len=512)
    with pytest.warns(RuntimeWarning, match="KV capacity is capped at 1355"):
        assert longer.kv_capacity((1100, "GGUF")) == 1100 + 256 - 1
    with pytest.raises(ValueError, match=r"1024 \(1000 rounded up .* 256\) .* at most 768 or"):
        cfg.kv_capacity((1000, "GGUF"))
    with pytest.raises(ValueError, match="prefill_chunk_size .* at most 200"):
        cfg.kv_capacity((200, "GGUF"))


def test_two_spellings_of_one_value_agree():
    cfg = PipelineConfig.from_kwargs("CPU", max_prompt_len=512, MAX_PROMPT_LEN="512")
    assert cfg.max_prompt_len == 512
    cfg = PipelineConfig.from_kwargs("CPU", prefix_reuse=False, PREFIX_REUSE="NO")
    assert cfg.prefix_reuse is False
    assert PipelineConfig.setting_name("NPUW_LLM_MIN_RESPONSE_LEN") == "min_response_len"
    assert PipelineConfig.setting_name("SNIPPETS_MODE") is None  # passed to compile_model


def test_the_paged_path_cache_size_can_be_given_by_name():
    cfg = PipelineConfig.from_kwargs("CPU", cpu_runtime_cache_capacity=100)
    assert cfg.compile_properties == {"CPU_RUNTIME_CACHE_CAPACITY": 100}


@pytest.mark.parametrize(
    ("config", "wide"),
    [
        ({"model_type": "gemma3_text"}, True),
        ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}, True),
        ({"model_type": "llama"}, False),
        (None, False),
    ],
)
def test_wide_activations_from_the_model_type(tmp_path, config, wide):
    from npuw_kv.model.families import wide_activations

    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert wide_activations(tmp_path) is wide


def test_decide_settles_every_auto_once():
    """``decide`` turns each ``auto`` into what the builders read; explicit settings stay."""
    core = ov.Core()
    cpu = decide(core, PipelineConfig.from_kwargs("CPU"))
    assert cpu.paged and cpu.kv_precision is None  # the paged plugin's own default (u8)
    assert not cpu.static_models and cpu.npuw_devices == ""
    exact = decide(core, PipelineConfig.from_kwargs("CPU", **EXACT_F32))
    assert exact.paged and exact.kv_precision == "f32" and exact.compute_precision == "f32"
    sdpa = decide(core, PipelineConfig.from_kwargs("CPU", attention_backend="sdpa", **EXACT_F32))
    assert not sdpa.paged and not sdpa.static_models and sdpa.kv_precision == "f32"
    assert (sdpa.prefill_ladder, sdpa.generate_ladder) == ("one", "one")
    npu = decide(core, PipelineConfig.from_kwargs("NPU"))
    assert not npu.paged and npu.static_models and npu.kv_precision == "f16"
    assert (npu.prefill_ladder, npu.generate_ladder) == ("lean", "lean")
    assert npu.npuw_devices == "CPU" and npu.npuw_f16 and not npu.v_transposed
    assert npu.dense_blocks and npu.window_rings
    full = PipelineConfig.from_kwargs(
        "NPU", prefill_attention="pyramid", generate_pyramid=True, optimize_v_tensors=True
    )
    decided = decide(core, full, wide_activations=True)
    assert (decided.prefill_ladder, decided.generate_ladder) == ("full", "full")
    assert decided.v_transposed and decided.dense_blocks  # V transposed too: dense pasts
    assert decided.kv_precision == "f32" and not decided.npuw_f16  # wide activations
    # an f32 KV cache turns NPUW's f16 tensors between sub-graphs off; an explicit value wins
    f32_kv = decide(core, PipelineConfig.from_kwargs("NPU", kv_precision="f32"))
    assert f32_kv.kv_precision == "f32" and not f32_kv.npuw_f16
    asked = decide(core, PipelineConfig.from_kwargs("NPU", kv_precision="f32", npuw_f16ic="yes"))
    assert asked.npuw_f16
    off = decide(core, PipelineConfig.from_kwargs("NPU", NPUW_F16IC="NO"))
    assert off.kv_precision == "f16" and not off.npuw_f16
    stored = decide(core, PipelineConfig.from_kwargs("NPU", prefix_cache_tokens=64))
    assert not stored.window_rings  # the host store keeps every layer's whole past
    text = "\n".join(npu.lines())
    assert "ladders          prefill lean, generate lean" in text and "f16" in text


class _BF16Core:
    """A core whose CPU computes bf16 by default, and no NPU."""

    available_devices = ["CPU"]

    def get_property(self, device: str, name: str):
        return {"INFERENCE_PRECISION_HINT": "bf16", "OPTIMIZATION_CAPABILITIES": ["BF16", "FP32"]}[
            name
        ]


@pytest.mark.parametrize(
    ("kwargs", "wide", "off"),
    [
        ({}, False, False),  # f16 tensors between the sub-graphs
        ({}, True, True),  # Gemma: f32 tensors between them, bf16 compute
        ({"kv_precision": "f32"}, False, True),
        ({"NPUW_F16IC": "NO"}, False, True),
        ({"kv_precision": "f32", "NPUW_F16IC": "YES"}, False, False),
        ({"kv_precision": "f32", "INFERENCE_PRECISION_HINT": "f32"}, False, False),
        ({"kv_precision": "f32", "npuw_devices": "NPU"}, False, False),  # no CPU sub-models
        ({"kv_precision": "f32", "SNIPPETS_MODE": "ENABLE"}, False, False),  # explicit wins
        ({"SNIPPETS_MODE": "DISABLE"}, False, True),
    ],
)
def test_cpu_snippets_off_where_npuw_gives_bf16_attention_f32_inputs(kwargs, wide, off):
    decided = decide(_BF16Core(), PipelineConfig.from_kwargs("NPU", **kwargs), wide)
    assert decided.cpu_snippets_off is off
    assert ("CPU snippets off" in "\n".join(decided.lines())) is off
    cpu = decide(_BF16Core(), PipelineConfig.from_kwargs("CPU", static_models=True, **EXACT_F32))
    assert not cpu.cpu_snippets_off


def test_npuw_llm_options_are_taken_or_refused_by_name_at_once():
    """Options of NPUW's own LLM pipeline npuw-kv does not map were passed to the NPU plugin,
    which refused them only when compiling (after a fold retry that blamed the model): now a
    MoE hint of DENSE is taken (how experts run here) and anything else is refused at once."""
    for key in ("NPUW_LLM_PREFILL_MOE_HINT", "npuw_llm_generate_moe_hint"):
        config = PipelineConfig.from_kwargs("NPU", **{key: "dense"})
        assert key.upper() not in config.compile_properties
        with pytest.raises(ValueError, match=f"{key.upper()}=HOST_ROUTED: npuw-kv runs a mixture"):
            PipelineConfig.from_kwargs("NPU", **{key: "HOST_ROUTED"})
        with pytest.raises(ValueError, match="hints are DENSE, HOST_ROUTED, DEVICE_ROUTED"):
            PipelineConfig.from_kwargs("NPU", **{key: "SPARSE"})
    with pytest.raises(ValueError, match="NPUW_LLM_ENABLE_PREFIX_CACHING is an option of NPUW's"):
        PipelineConfig.from_kwargs("NPU", NPUW_LLM_ENABLE_PREFIX_CACHING="YES")
    assert PipelineConfig.from_kwargs("NPU", NPUW_LLM_MAX_PROMPT_LEN=256).max_prompt_len == 256
