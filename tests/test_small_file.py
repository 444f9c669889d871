"""Small files read whole (configs, manifests): a FIFO, a device or an oversized file in their
place is refused at once, never a hang or a read until memory runs out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npuw_kv.model.cache_entry import MANIFEST, MANIFEST_LIMIT, entry_problem
from npuw_kv.model.small_file import read_small
from npuw_kv.model.source import read_json

pytestmark = pytest.mark.unit


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b'{"x": 1}')
    assert read_small(tmp_path / "a.json") == b'{"x": 1}'


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # a plain read would wait for a writer forever
    with pytest.raises(ValueError, match="is not a regular file"):
        read_small(fifo)


def test_a_device_is_refused() -> None:
    with pytest.raises(ValueError, match="/dev/zero is not a regular file"):
        read_small(Path("/dev/zero"))


def test_a_file_over_the_bound_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as out:
        out.truncate(10_001)  # sparse: nothing is written, nothing needs to be read
    with pytest.raises(ValueError, match="10,001 bytes, more than the 10,000 expected"):
        read_small(big, limit=10_000)


def test_a_config_that_is_a_fifo_is_a_load_error_naming_it(tmp_path: Path) -> None:
    from npuw_kv.errors import ModelLoadError

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON .*not a regular file"):
        read_json(tmp_path / "config.json")


def test_a_manifest_that_is_a_fifo_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    os.mkfifo(tmp_path / MANIFEST)
    assert entry_problem(tmp_path, ["a"]) is None  # as an entry from before manifests
    assert (tmp_path / MANIFEST).is_file()


def test_an_oversized_manifest_makes_the_entry_converted_again(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    with (tmp_path / MANIFEST).open("wb") as out:
        out.truncate(MANIFEST_LIMIT + 1)
    problem = entry_problem(tmp_path, ["a"])
    assert problem is not None and "unreadable" in problem
