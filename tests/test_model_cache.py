"""The converted-model cache: a damaged entry is converted again (saying so), two processes
converting the same model convert it once, and file system errors are one line naming the
directory and NPUW_KV_CACHE_DIR."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from npuw_kv.errors import ModelSourceError
from npuw_kv.model import cache_entry
from npuw_kv.model.cache_entry import MANIFEST, entry_problem
from npuw_kv.model.ir_cache import IR_FILES, TOKENIZER_FILES
from npuw_kv.model.source import convert_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = IR_FILES + TOKENIZER_FILES


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(
        tmp_path_factory.mktemp("tiny") / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0"
    )


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> Path:
    """A pristine cache entry, copied by each test that damages it."""
    return convert_gguf(tiny, tmp_path_factory.mktemp("cache"), log=lambda *a, **k: None)


def entry_copy(converted: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(converted, cache / converted.name)
    return cache


def convert_logged(tiny: Path, cache: Path) -> tuple[Path, list[str]]:
    lines: list[str] = []
    path = convert_gguf(tiny, cache, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return path, lines


def test_a_fresh_entry_has_a_manifest_and_loads_without_converting(tiny, converted, tmp_path):
    assert (converted / MANIFEST).is_file() and entry_problem(converted, REQUIRED) is None
    cache = entry_copy(converted, tmp_path)
    path, lines = convert_logged(tiny, cache)
    assert path == cache / converted.name and lines == []


@pytest.mark.parametrize(
    "damage, phrase",
    [
        (lambda e: (e / "openvino_model.bin").write_bytes(b"x" * 100), "openvino_model.bin has"),
        (lambda e: (e / "openvino_tokenizer.bin").unlink(), "openvino_tokenizer.bin missing"),
        (lambda e: (e / "openvino_model.xml").write_text("<net/>"), "openvino_model.xml"),
        (lambda e: (e / MANIFEST).write_text("{"), "unreadable"),
    ],
)
def test_a_damaged_entry_is_converted_again(tiny, converted, tmp_path, damage, phrase):
    cache = entry_copy(converted, tmp_path)
    entry = cache / converted.name
    damage(entry)
    problem = entry_problem(entry, REQUIRED)
    assert problem is not None and phrase in problem
    path, lines = convert_logged(tiny, cache)
    assert path == entry and entry_problem(entry, REQUIRED) is None
    assert any("is damaged" in line and phrase in line for line in lines), lines
    bins = ("openvino_model.bin", "openvino_tokenizer.bin")
    assert all((entry / f).read_bytes() == (converted / f).read_bytes() for f in bins)


def test_an_entry_from_before_manifests_is_kept_and_given_one(tiny, converted, tmp_path):
    cache = entry_copy(converted, tmp_path)
    (cache / converted.name / MANIFEST).unlink()
    path, lines = convert_logged(tiny, cache)
    assert lines == [] and (path / MANIFEST).is_file()


RESOLVE = """
import sys
from pathlib import Path
from npuw_kv.model.source import convert_gguf
print(convert_gguf(Path(sys.argv[1]), Path(sys.argv[2])))
"""


def test_two_processes_convert_the_same_model_once(tiny, tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE, str(tiny), str(cache)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the same entry
    converting = sum(err.count("converting tiny.gguf") for _, err in outs)
    assert converting == 1, outs


def test_cache_dir_naming_a_file(tiny, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(ModelSourceError) as info:
        convert_gguf(tiny, blocker, log=lambda *a, **k: None)
    message = str(info.value)
    assert str(blocker) in message and "NPUW_KV_CACHE_DIR" in message and "\n" not in message


@pytest.mark.parametrize(
    "code, phrase",
    [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only"), (errno.EACCES, "not writable")],
)
def test_file_system_errors_are_one_line(tiny, tmp_path, monkeypatch, code, phrase):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "cache" / "x"))

    monkeypatch.setattr(cache_entry, "conversion_dir", fail)
    with pytest.raises(ModelSourceError) as info:
        convert_gguf(tiny, tmp_path / "cache", log=lambda *a, **k: None)
    message = str(info.value)
    assert phrase in message and "NPUW_KV_CACHE_DIR" in message and str(tmp_path) in message


def test_a_second_caller_waits_for_the_first_conversion_and_reuses_it(tmp_path):
    entry = tmp_path / "cache" / "model"
    started, release = threading.Event(), threading.Event()
    made: list[str] = []
    logs: list[str] = []

    def slow_make(work: Path) -> None:
        made.append("first")
        started.set()
        assert release.wait(60)
        for name in REQUIRED:
            (work / name).write_text(name)

    def second_make(work: Path) -> None:
        made.append("second")

    first = threading.Thread(
        target=cache_entry.cached_entry, args=(entry, REQUIRED, slow_make, print)
    )
    first.start()
    assert started.wait(60)
    result: list[Path] = []
    second = threading.Thread(
        target=lambda: result.append(
            cache_entry.cached_entry(
                entry, REQUIRED, second_make, lambda *a, **k: logs.append(a[0])
            )
        )
    )
    second.start()
    deadline = time.monotonic() + 60
    while not logs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert logs and "waiting for another process" in logs[0]
    release.set()
    first.join(60)
    second.join(60)
    assert made == ["first"] and result == [entry]
    assert entry_problem(entry, REQUIRED) is None


def test_a_truncated_ir_outside_the_cache_is_one_clear_error(converted, tmp_path):
    from npuw_kv import LLMPipeline
    from npuw_kv.errors import ModelLoadError

    model = tmp_path / "ir"
    shutil.copytree(converted, model)
    with (model / "openvino_model.bin").open("r+b") as weights:
        weights.truncate(1000)
    with pytest.raises(ModelLoadError) as info:
        LLMPipeline(model, "CPU")
    message = str(info.value)
    assert "Incorrect weights in bin file" in message and "copy the model again" in message
    assert "\n" not in message and "Exception from" not in message


def test_a_converter_failure_on_a_full_disk_says_so(tiny, tmp_path, monkeypatch):
    import collections

    import openvino_genai

    from npuw_kv.model import source

    def full_disk(*args, **kwargs):
        raise RuntimeError("Exception from src/x.cpp:1:\nbasic_ios::clear: iostream error")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(openvino_genai, "LLMPipeline", full_disk)
    monkeypatch.setattr(source.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 4096))
    with pytest.raises(ModelSourceError) as info:
        convert_gguf(tiny, tmp_path / "cache", log=lambda *a, **k: None)
    message = str(info.value)
    assert "iostream error" in message and "0 MB free" in message
    assert "NPUW_KV_CACHE_DIR" in message and "\n" not in message


@pytest.mark.unit
@pytest.mark.parametrize(
    ("files", "phrase"),
    [
        (["a"], "'files' is not an object"),
        ({"a": "big"}, "the entry of 'a' is not an object"),
        ({"a": {"sha256": "0"}}, "'a' has no size (got None)"),
        ({"a": {"size": "big", "sha256": "0"}}, "'a' has no size (got 'big')"),
        ({"a": {"size": True, "sha256": "0"}}, "'a' has no size (got True)"),
        ({"a": {"size": 1}}, "'a' has no sha256"),
        ({"../../etc/passwd": {"size": 1, "sha256": "0"}}, "is not a file inside the entry"),
        ({"/etc/passwd": {"size": 1, "sha256": "0"}}, "is not a file inside the entry"),
    ],
)
def test_a_malformed_manifest_reads_as_damage_not_an_error(tmp_path, files, phrase):
    """A manifest whose fields have the wrong type is a damaged entry (converted again, one
    line saying why), not a raw Python error."""
    import json

    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / MANIFEST).write_text(json.dumps({"version": 1, "files": files}))
    problem = entry_problem(tmp_path, ["a"])
    assert problem is not None and phrase in problem
