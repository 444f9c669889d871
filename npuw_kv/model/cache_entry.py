"""A converted model's cache entry: made once, checked at every load, made again if damaged.

A conversion writes a manifest last (each file's size and a checksum), so an entry whose
conversion did not finish, or whose files were truncated, deleted or overwritten since, is
seen at load and converted again, with one line saying so.  While one process converts an
entry, another that wants the same entry waits for it (a flock beside the entry) and then uses
it, rather than converting it a second time.  A file system error on the cache (read-only, full,
``NPUW_KV_CACHE_DIR`` naming a file) becomes one :class:`~npuw_kv.errors.ModelSourceError`
naming the directory and the variable.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import ModelSourceError
from .ir_cache import LOCK_FILE, conversion_dir
from .small_file import read_small

if sys.platform != "win32":
    import fcntl

MANIFEST = "npuw_kv_manifest.json"
MANIFEST_LIMIT = 16 << 20  # a few kB in practice: a bigger one is not ours
WHOLE_HASH_BYTES = 64 << 20  # files up to this size are hashed whole; larger ones at both ends
END_BYTES = 4 << 20  # how much of each end of a large file is hashed (with its size)


def _digest(path: Path, size: int) -> str:
    """sha256 of the whole file, or of its first and last :data:`END_BYTES` when larger than
    :data:`WHOLE_HASH_BYTES` (with the size, that catches truncation and a rewritten file while
    costing milliseconds for a 1 GB weights file)."""
    sha = hashlib.sha256()
    with path.open("rb") as file:
        if size <= WHOLE_HASH_BYTES:
            for block in iter(lambda: file.read(1 << 20), b""):
                sha.update(block)
        else:
            sha.update(file.read(END_BYTES))
            file.seek(size - END_BYTES)
            sha.update(file.read(END_BYTES))
    return sha.hexdigest()


def _files(entry: Path) -> Iterator[Path]:
    for path in sorted(entry.rglob("*")):
        if path.is_file() and path.name not in (MANIFEST, LOCK_FILE):
            yield path


def write_manifest(entry: Path) -> None:
    """Record every file of ``entry`` (written last: an entry without it is unfinished)."""
    files = {}
    for path in _files(entry):
        size = path.stat().st_size
        files[path.relative_to(entry).as_posix()] = {"size": size, "sha256": _digest(path, size)}
    fresh = entry / (MANIFEST + ".new")
    fresh.write_text(json.dumps({"version": 1, "files": files}, indent=1))
    os.replace(fresh, entry / MANIFEST)


def entry_problem(entry: Path, required: Iterable[str]) -> str | None:
    """What is wrong with the cache entry (None: it is whole).  "missing" when there is none.

    An entry from before manifests (its ``required`` files all there) is taken as it is and
    given a manifest when the cache is writable, so that later damage is seen."""
    if not entry.is_dir():
        return "missing"
    absent = [name for name in required if not (entry / name).is_file()]
    manifest = entry / MANIFEST
    if not manifest.is_file():
        if absent:
            return f"{', '.join(absent)} missing"
        with contextlib.suppress(OSError):
            write_manifest(entry)
        return None
    files = _recorded(manifest)
    if isinstance(files, str):
        return files
    for name in absent:
        if name not in files:
            return f"{name} missing"
    for name, (want, sha256) in files.items():
        path = entry / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} missing"
        if size != want:
            return f"{name} has {size:,} bytes, {want:,} were written"
        if _digest(path, size) != sha256:
            return f"{name} changed since it was written"
    return None


def _recorded(manifest: Path) -> dict[str, tuple[int, str]] | str:
    """Each file the manifest records, with its size and sha256; or what is wrong with the
    manifest (then the entry is converted again), every field checked for its type."""
    try:
        files: Any = json.loads(read_small(manifest, MANIFEST_LIMIT))["files"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{MANIFEST} unreadable"
    if not isinstance(files, dict):
        return f"{MANIFEST}: 'files' is not an object"
    out = {}
    for name, want in files.items():
        if not isinstance(want, dict):
            return f"{MANIFEST}: the entry of {name!r} is not an object"
        size, sha256 = want.get("size"), want.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{MANIFEST}: {name!r} has no size (got {size!r})"
        if not isinstance(sha256, str):
            return f"{MANIFEST}: {name!r} has no sha256 (got {sha256!r})"
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            return f"{MANIFEST}: {name!r} is not a file inside the entry"
        out[name] = (size, sha256)
    return out


@contextlib.contextmanager
def entry_lock(entry: Path, log: Callable[..., None]) -> Iterator[None]:
    """Hold ``<cache>/.<entry>.lock`` while making ``entry``: another process that wants the
    same entry waits here (saying so), then finds it made."""
    if sys.platform == "win32":
        yield
        return
    lock = entry.parent / f".{entry.name}.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[npuw-kv] waiting for another process converting into {entry}", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
        # made: whoever comes later finds the entry whole before it looks for the lock, and
        # whoever waits on this file finds it whole once it has the lock
        lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def cached_entry(
    entry: Path,
    required: Iterable[str],
    make: Callable[[Path], None],
    log: Callable[..., None],
    prerequisites: Callable[[], object] | None = None,
) -> Path:
    """``entry``, made by ``make(work_dir)`` unless it is already whole; a damaged one is made
    again (saying why).  ``prerequisites()`` runs first when it must be made (what it raises,
    e.g. a missing converter, comes before anything is written).  File system errors come out
    as :class:`ModelSourceError`."""
    required = tuple(required)
    try:
        if entry_problem(entry, required) is None:
            return entry
        if prerequisites is not None:
            prerequisites()
        entry.parent.mkdir(parents=True, exist_ok=True)
        with entry_lock(entry, log):
            problem = entry_problem(entry, required)  # made meanwhile by the process we waited for
            if problem is None:
                return entry
            if problem != "missing":
                log(f"[npuw-kv] the cached conversion in {entry} is damaged ({problem}); "
                    "converting it again", file=sys.stderr)  # fmt: skip
            with conversion_dir(entry) as work:
                make(work)
                write_manifest(work)
        return entry
    except ModelSourceError:
        raise
    except OSError as exc:
        raise cache_error(entry.parent, exc) from exc


def cache_error(root: Path, exc: OSError) -> ModelSourceError:
    """One line for a file system error on the cache: what, where, and what to change."""
    fix = "set NPUW_KV_CACHE_DIR to a writable directory with room for the converted model"
    if exc.errno == errno.ENOSPC:
        what = "no space left on the device"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        what = "it is not writable" + (
            " (read-only file system)" if exc.errno == errno.EROFS else ""
        )
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR) or (root.exists() and not root.is_dir()):
        what = "a file is in the way of the cache directory"
    else:
        what = exc.strerror or str(exc)
    where = exc.filename or root
    return ModelSourceError(f"cannot use the model cache {root} ({where}): {what}; {fix}")
