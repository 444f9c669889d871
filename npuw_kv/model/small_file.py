"""Small files read whole (JSON configs, manifests): regular files of bounded size only.

A model directory is the user's, and anything can sit where ``config.json`` is expected: a
FIFO blocks a plain read forever, ``/dev/zero`` (or a huge file) reads until memory runs out.
The file is opened without blocking, checked to be a regular file on the open descriptor (no
window for a swap between a check and the open), and read to at most its bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

JSON_LIMIT = 64 * 2**20  # a tokenizer_config.json with long chat templates is a few MB


def read_small(path: Path, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of ``path``; ``ValueError`` when it is not a regular file or holds more than
    ``limit`` bytes, ``OSError`` when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} has {info.st_size:,} bytes, more than the {limit:,} expected")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        raise ValueError(f"{path} has more than the {limit:,} bytes expected")
    return data
