"""The package's public names: every one in ``__all__`` loads (``from npuw_kv import *``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_star_import_gives_every_public_name():
    # a fresh interpreter: the names load lazily, on first use
    code = (
        "import npuw_kv\n"
        "names = {}\n"
        "exec('from npuw_kv import *', names)\n"
        "missing = [n for n in npuw_kv.__all__ if n not in names]\n"
        "assert not missing, missing\n"
        "print(len(npuw_kv.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 20


# openvino-genai's text-generation API, as its python/openvino_genai/__init__.py lists it
# (streamers, parsers, LLMPipeline, LoRA, GenerationConfig, chat history, tokenizer,
# continuous batching): under `import npuw_kv as openvino_genai` each must resolve
GENAI_TEXT_API = [
    "DecodedResults",
    "EncodedResults",
    "RawPerfMetrics",
    "PerfMetrics",
    "StreamerBase",
    "get_version",
    "StreamingStatus",
    "TextStreamer",
    "TextParserStreamer",
    "Parser",
    "VLLMParserWrapper",
    "ReasoningParser",
    "DeepSeekR1ReasoningParser",
    "Phi4ReasoningParser",
    "Llama3JsonToolParser",
    "Llama3PythonicToolParser",
    "IncrementalParser",
    "ReasoningIncrementalParser",
    "DeepSeekR1ReasoningIncrementalParser",
    "Phi4ReasoningIncrementalParser",
    "LLMPipeline",
    "draft_model",
    "Adapter",
    "AdapterConfig",
    "GenerationConfig",
    "StructuralTagItem",
    "StructuralTagsConfig",
    "StructuredOutputConfig",
    "StopCriteria",
    "ChatHistory",
    "TokenizedInputs",
    "Tokenizer",
    "ContinuousBatchingPipeline",
    "GenerationFinishReason",
    "GenerationResult",
    "GenerationStatus",
    "SchedulerConfig",
    "CacheEvictionConfig",
    "AggregationMode",
    "SparseAttentionMode",
    "SparseAttentionConfig",
    "KVCrushAnchorPointMode",
    "KVCrushConfig",
]


def test_every_name_of_genais_text_api_resolves_ours_or_genais_own():
    import openvino_genai

    import npuw_kv

    assert set(GENAI_TEXT_API) == {*npuw_kv.GENAI_TYPES, *npuw_kv.OWN_NAMES}
    assert set(GENAI_TEXT_API) <= set(npuw_kv.__all__)
    for name in npuw_kv.GENAI_TYPES:  # passed through: the very objects genai has
        assert getattr(npuw_kv, name) is getattr(openvino_genai, name), name
    for name in npuw_kv.OWN_NAMES:
        assert getattr(npuw_kv, name) is not getattr(openvino_genai, name), name
    from npuw_kv import AggregationMode, CacheEvictionConfig, KVCrushConfig  # noqa: F401


@pytest.mark.parametrize(
    "name", ["WhisperGenerationConfig", "WhisperPipeline", "VLMPipeline", "Text2ImagePipeline"]
)
def test_a_name_outside_text_generation_is_genais_own_object(name: str):
    import openvino_genai

    import npuw_kv

    assert getattr(npuw_kv, name) is getattr(openvino_genai, name)
    assert name in dir(npuw_kv)


def test_genais_modules_and_unknown_names_are_not_passed_through():
    import npuw_kv

    for name in ("os", "openvino", "py_openvino_genai", "NoSuchPipeline"):
        with pytest.raises(AttributeError, match=name):
            getattr(npuw_kv, name)


def test_the_version_says_npuw_kv_and_the_genai_it_follows():
    from importlib.metadata import version

    import npuw_kv

    ours = f"{version('npuw-kv')}+genai.{version('openvino-genai')}"
    assert npuw_kv.__version__ == ours == npuw_kv.get_version()


@pytest.mark.parametrize("field", ["use_cache_eviction", "use_sparse_attention"])
def test_an_eviction_or_sparse_attention_config_is_refused_by_field(field: str):
    import npuw_kv
    from npuw_kv.api.pipeline_args import scheduler_settings

    scheduler = npuw_kv.SchedulerConfig()  # as genai's eviction test and sample build it
    setattr(scheduler, field, True)
    scheduler.cache_eviction_config = npuw_kv.CacheEvictionConfig(
        start_size=32,
        recent_size=32,
        max_cache_size=128,
        aggregation_mode=npuw_kv.AggregationMode.NORM_SUM,
        kvcrush_config=npuw_kv.KVCrushConfig(budget=2),
    )
    scheduler.sparse_attention_config = npuw_kv.SparseAttentionConfig(
        mode=npuw_kv.SparseAttentionMode.TRISHAPE
    )
    with pytest.raises(npuw_kv.UsageError, match=f"scheduler_config.{field}"):
        scheduler_settings(scheduler, "CPU", {"attention_backend": "pa"})


def test_generation_result_is_genais_as_genais_test_helpers_build_it():
    import openvino_genai

    import npuw_kv

    result = npuw_kv.GenerationResult()  # genai's tests fill one in field by field
    result.m_generation_ids = ["a", "b"]
    assert result.m_generation_ids == ["a", "b"]
    assert npuw_kv.GenerationResult is openvino_genai.GenerationResult


def test_cache_interval_multiplier_sets_the_state_checkpoint_interval():
    """genai's ``cache_interval_multiplier``: checkpoints of a hybrid model's states every that
    many 32-token blocks (``state_checkpoint_interval``); 0, or the static-shape path, refused."""
    import npuw_kv
    from npuw_kv.api.pipeline_args import scheduler_settings
    from npuw_kv.config.pipeline_config import PipelineConfig

    scheduler = npuw_kv.SchedulerConfig()
    scheduler.cache_interval_multiplier = 2
    settings = scheduler_settings(scheduler, "CPU", {"attention_backend": "pa"})
    assert settings["state_checkpoint_interval"] == 64
    assert PipelineConfig.from_kwargs("CPU", **settings).state_checkpoint_interval == 64
    for device, backend in (("NPU", "auto"), ("CPU", "sdpa")):
        with pytest.raises(npuw_kv.UsageError, match="cache_interval_multiplier .*static-shape"):
            scheduler_settings(scheduler, device, {"attention_backend": backend})
    with pytest.raises(
        npuw_kv.UsageError,
        match=r"state_checkpoint_interval \(STATE_CHECKPOINT_INTERVAL\) applies to",
    ):
        PipelineConfig.from_kwargs("CPU", attention_backend="sdpa", state_checkpoint_interval=64)
    scheduler.cache_interval_multiplier = 0
    with pytest.raises(npuw_kv.UsageError, match="cache_interval_multiplier=0 .*multiplier > 0"):
        scheduler_settings(scheduler, "CPU", {"attention_backend": "pa"})
