"""The cache of converted models: where it is, the locked work folder a conversion writes in,
and the record of what a conversion drops from its source.

A conversion (a GGUF by openvino-genai, :mod:`~.source`; Gemma 3 by transformers and
optimum-intel, :mod:`~.gemma3`) works in a ``.convert-*`` folder of the cache root, holding a
flock inside it, and the folder becomes the model's directory only when it succeeded; a later
conversion removes the folders of conversions whose process died.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.platform != "win32":
    import fcntl

if TYPE_CHECKING:
    import gguf as gguf_py

IR_FILES = ("openvino_model.xml", "openvino_model.bin")
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")
# what the converted IR no longer says about its GGUF (e.g. the trained context length)
SOURCE_INFO = "npuw_kv_source.json"
# a conversion works in <cache root>/.convert-*/ and holds a lock on LOCK_FILE inside it
CONVERT_PREFIX = ".convert-"
LOCK_FILE = ".npuw_kv.lock"
# a work folder without a lock file (no flock here, or left by an older npuw-kv) counts as
# abandoned once untouched this long: far longer than any conversion's quiet spell
STALE_AFTER_S = 3600.0


def cache_root() -> Path:
    root = os.environ.get("NPUW_KV_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "npuw-kv"


@contextlib.contextmanager
def conversion_dir(target: Path) -> Iterator[Path]:
    """A locked work folder for a conversion, moved to ``target`` when the block succeeds.

    TemporaryDirectory removes the folder (and whatever the conversion put there) on every way
    out of the block but a crash; :func:`remove_stale_conversions` then removes it on a later
    conversion.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_conversions(target.parent)
    with (
        tempfile.TemporaryDirectory(
            dir=target.parent, prefix=CONVERT_PREFIX, ignore_cleanup_errors=True
        ) as tmp,
        _conversion_lock(Path(tmp)),
    ):
        yield Path(tmp)
        (Path(tmp) / LOCK_FILE).unlink(missing_ok=True)  # not part of the IR directory
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        Path(tmp).mkdir()  # TemporaryDirectory cleanup expects it to exist


@contextlib.contextmanager
def _conversion_lock(work_dir: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``work_dir/LOCK_FILE`` while converting.

    The kernel drops the lock when the process dies, however it dies, so a later conversion
    tells a crashed one's folder from a live one's (in another process or container on this
    machine) without guessing from pids, which are reused and differ between containers, or
    from ages, which a long conversion of a large model could exceed.
    """
    fd = _locked_file(work_dir)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _locked_file(work_dir: Path) -> int | None:
    if sys.platform == "win32":
        return None
    fresh = work_dir / (LOCK_FILE + ".new")
    try:
        fd = os.open(fresh, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # renamed only once locked: a cleaner never finds the lock file unlocked while its
        # owner lives
        os.replace(fresh, work_dir / LOCK_FILE)
    except OSError:  # a file system without flock: the age rule alone protects the folder
        os.close(fd)
        fresh.unlink(missing_ok=True)
        return None
    return fd


def remove_stale_conversions(root: Path) -> list[Path]:
    """Remove conversion work folders in ``root`` whose process died; return them.

    A converter crash (SIGSEGV), SIGKILL or power loss skips TemporaryDirectory's cleanup and
    leaves a folder holding a full copy of the GGUF.
    """
    removed = []
    now = time.time()
    for work in sorted(root.glob(CONVERT_PREFIX + "*")):
        if work.is_dir() and not work.is_symlink() and _abandoned(work, now):
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
    return removed


def _abandoned(work: Path, now: float) -> bool:
    """No live process holds the folder's lock; or, without a lock file, untouched for
    :data:`STALE_AFTER_S` (this also covers the moment before a new conversion locks)."""
    held = _lock_held(work / LOCK_FILE)
    if held is not None:
        return not held
    try:
        return now - work.stat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def _lock_held(lock: Path) -> bool | None:
    """Whether a process holds ``lock``; None if that cannot be told (no file, no flock)."""
    if sys.platform == "win32":
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        # shared: conflicts with the owner's exclusive lock, and needs only read access
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def source_info(gguf: Path, fields: Mapping[str, gguf_py.ReaderField]) -> dict[str, object]:
    """The GGUF's trained context length and sliding window, which the converters drop."""
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
    return info


def write_source_info(ir_dir: Path, info: Mapping[str, Any]) -> None:
    """Record :func:`source_info` next to the IR."""
    (ir_dir / SOURCE_INFO).write_text(json.dumps(info, indent=1))
