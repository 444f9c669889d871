"""A damaged GGUF is refused with a one-line message before openvino-genai's converter sees it.

The converter dies with SIGSEGV on a truncated file or an absurd count in the header, and each
such crash left a work folder with a full copy of the GGUF in the cache; a later conversion
removes such folders.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from npuw_kv import ModelSourceError
from npuw_kv.model import ir_cache, source
from npuw_kv.model.gguf_check import check_gguf
from npuw_kv.model.ir_cache import (
    CONVERT_PREFIX,
    LOCK_FILE,
    SOURCE_INFO,
    STALE_AFTER_S,
    remove_stale_conversions,
)
from npuw_kv.model.source import default_gguf, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUGE = 2**63 - 1


def quiet(*args: object, **kwargs: object) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(
        tmp_path_factory.mktemp("tiny") / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0"
    )


def leftovers(cache: Path) -> list[Path]:
    return list(cache.glob(CONVERT_PREFIX + "*"))


def rejected(path: Path, cache: Path) -> str:
    """The message of the ModelSourceError ``path`` raises; checks nothing is left behind."""
    with pytest.raises(ModelSourceError) as info:
        resolve_model(path, cache_dir=cache, log=quiet)
    message = str(info.value)
    assert message.startswith(f"could not convert {path}: ")
    assert "\n" not in message
    assert not leftovers(cache)
    return message


# --- damaged copies of the tiny GGUF --------------------------------------------------------


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@functools.cache
def metadata(path: Path) -> gguf.GGUFReader:
    return check_gguf(path)


def field_value_offset(path: Path, key: str) -> int:
    """Byte offset of metadata ``key``'s value (after its key string and value type)."""
    field = metadata(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def tensor_type_offset(path: Path, index: int) -> int:
    field = metadata(path).tensors[index].field
    name_len, name, n_dims = field.parts[:3]
    return field.offset + 8 + len(bytes(name)) + 4 + 8 * int(n_dims[0])


def tensor_dim_offset(path: Path, index: int, dim: int) -> int:
    """Byte offset of tensor ``index``'s dimension ``dim`` (GGUF lists the fastest first)."""
    field = metadata(path).tensors[index].field
    return field.offset + 8 + len(bytes(field.parts[1])) + 4 + 8 * dim


def resized(data: bytes, path: Path, index: int, factor: float) -> bytes:
    """Tensor ``index``'s second dimension declared ``factor`` times its real size."""
    at = tensor_dim_offset(path, index, 1)
    return patched(data, at, "<Q", int(struct.unpack_from("<Q", data, at)[0] * factor))


def six_dim_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("odd.weight", np.zeros((1, 1, 1, 1, 2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def half(data: bytes, tiny: Path) -> bytes:
    return data[: len(data) // 2]


# name -> (bytes of the damaged file from the tiny file's bytes and path, expected phrases)
DAMAGED: dict[str, tuple[Callable[[bytes, Path], bytes], tuple[str, ...]]] = {
    "100-byte prefix": (lambda d, p: d[:100], ("truncated", "more than 100 bytes can hold")),
    "half the file": (half, ("truncated: tensor 'token_embd.weight' ends at byte",)),
    "header only": (lambda d, p: d[:24], ("truncated", "24 bytes")),
    "3-byte prefix": (lambda d, p: d[:3], ("truncated: 3 bytes",)),
    "tensor count one too many": (
        lambda d, p: patched(d, 8, "<Q", struct.unpack_from("<Q", d, 8)[0] + 1),
        ("truncated: tensor 'blk.1.ffn_down.weight' ends at byte",),  # data start moved on
    ),
    "tensor count 2^63-1": (
        lambda d, p: patched(d, 8, "<Q", HUGE),
        (f"{HUGE:,} tensors", "truncated or corrupt"),
    ),
    "metadata key count 2^63-1": (
        lambda d, p: patched(d, 16, "<Q", HUGE),
        (f"{HUGE:,} metadata keys", "truncated or corrupt"),
    ),
    "metadata key count one too many": (
        lambda d, p: patched(d, 16, "<Q", struct.unpack_from("<Q", d, 16)[0] + 1),
        ("truncated or corrupt: the metadata runs to byte",),
    ),
    "bad magic": (lambda d, p: b"GGUX" + d[4:], ("not a GGUF file", "b'GGUX'")),
    "not a GGUF at all": (lambda d, p: b"<html>404 Not Found</html>", ("not a GGUF file",)),
    "version 99": (lambda d, p: patched(d, 4, "<I", 99), ("GGUF version 99",)),
    "big-endian": (lambda d, p: patched(d, 4, ">I", 3), ("big-endian",)),
    "vocabulary array length 2^40": (
        lambda d, p: patched(d, field_value_offset(p, "tokenizer.ggml.tokens") + 4, "<Q", 2**40),
        ("corrupt metadata: an array of 1,099,511,627,776 items",),
    ),
    "unknown tensor type": (
        lambda d, p: patched(d, tensor_type_offset(p, 0), "<I", 77),
        ("tensor 'token_embd.weight' has unknown type 77",),
    ),
    "no architecture key": (
        lambda d, p: d.replace(b"general.architecture", b"general.architecturX", 1),
        ("no general.architecture key",),
    ),
    "empty file": (lambda d, p: b"", ("empty file (0 bytes)",)),
    "a tensor declared twice its size": (  # its data runs into the next one, inside the file
        lambda d, p: resized(d, p, 3, 2),
        ("corrupt tensor table: tensor 'blk.0.attn_q.weight'", "runs into tensor"),
    ),
    "an embedding smaller than the vocabulary": (
        lambda d, p: resized(d, p, 0, 0.5),
        ("token_embd.weight has", "rows, fewer than the tokenizer's"),
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_gguf_is_refused(case, tiny, tmp_path):
    make, phrases = DAMAGED[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(make(tiny.read_bytes(), tiny))
    message = rejected(bad, tmp_path / "cache")
    for phrase in phrases:
        assert phrase in message


def test_half_file_names_the_byte_counts(tiny, tmp_path):
    bad = tmp_path / "half.gguf"
    bad.write_bytes(half(tiny.read_bytes(), tiny))
    message = rejected(bad, tmp_path / "cache")
    size = bad.stat().st_size
    assert message.endswith(f"beyond the file's {size:,} bytes")


def test_more_than_four_dims_is_refused(tmp_path):
    bad = tmp_path / "dims.gguf"
    six_dim_gguf(bad)
    assert "tensor 'odd.weight' has 6 dims, more than 4" in rejected(bad, tmp_path / "cache")


def test_a_directory_named_gguf_is_refused(tmp_path):
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    assert "directory, not a GGUF file" in rejected(folder, tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="directory, not a GGUF file"):
        source.convert_gguf(folder, tmp_path / "cache", log=quiet)


def test_prefixes_of_the_real_smollm2_gguf(tmp_path):
    """The metadata of the shipped model is in its first 1.8 MB; 10 MB holds few tensors."""
    real = default_gguf()
    with real.open("rb") as file:
        head = file.read(10_000_000)
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(head[:100])
    big.write_bytes(head)
    assert "truncated" in rejected(small, tmp_path / "cache")
    message = rejected(big, tmp_path / "cache")
    assert "truncated: tensor '" in message and "beyond the file's 10,000,000 bytes" in message


def test_the_real_gguf_passes_in_well_under_a_second():
    start = time.perf_counter()
    reader = check_gguf(default_gguf())
    elapsed = time.perf_counter() - start
    assert len(reader.tensors) == 272
    assert elapsed < 5.0, f"check took {elapsed:.2f} s"  # ~0.6 s; generous on a busy machine


def test_cli_exits_with_an_error_not_a_crash(tiny, tmp_path):
    bad = tmp_path / "half.gguf"
    bad.write_bytes(half(tiny.read_bytes(), tiny))
    cache = tmp_path / "cache"
    code = "import sys; from npuw_kv.cli.commands import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "inspect", "--model", str(bad)],
        cwd=ROOT,
        env={**os.environ, "NPUW_KV_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode > 0, result  # a signal would make it negative
    assert "truncated: tensor 'token_embd.weight'" in result.stderr
    assert not leftovers(cache)


# --- the cache: work folders of failed and crashed conversions ---------------------------------


def test_converter_failure_leaves_no_work_folder(tiny, tmp_path, monkeypatch):
    import openvino_genai

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unsupported layer")

    monkeypatch.setattr(openvino_genai, "LLMPipeline", fail)
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="could not convert .*unsupported layer"):
        resolve_model(tiny, cache_dir=cache, log=quiet)
    assert not leftovers(cache)


def work_folder(cache: Path, name: str, age_s: float = 0.0) -> Path:
    folder = cache / f"{CONVERT_PREFIX}{name}"
    folder.mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"GGUF copy")
    if age_s:
        then = time.time() - age_s
        os.utime(folder, (then, then))
    return folder


def test_stale_rules(tmp_path):
    """A folder goes once its owner's lock is free, or without a lock once an hour idle."""
    cache = tmp_path / "cache"
    live = work_folder(cache, "live", age_s=10 * STALE_AFTER_S)
    young = work_folder(cache, "young")
    old = work_folder(cache, "old", age_s=2 * STALE_AFTER_S)
    with ir_cache._conversion_lock(live):
        assert (live / LOCK_FILE).is_file()
        assert remove_stale_conversions(cache) == [old]
        assert live.is_dir() and young.is_dir()
    assert remove_stale_conversions(cache) == [live]  # lock released: its owner is gone
    assert young.is_dir()


CRASH = """
import os, signal, sys
from pathlib import Path
import openvino_genai
from npuw_kv.model.source import convert_gguf

openvino_genai.LLMPipeline = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), log=lambda *a, **k: None)
"""


def test_conversion_after_a_crash_cleans_up_and_converts(tiny, tmp_path):
    cache = tmp_path / "cache"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH, str(tiny), str(cache)], cwd=ROOT, timeout=300
    )
    assert crashed.returncode == -signal.SIGKILL
    (debris,) = leftovers(cache)
    assert (debris / tiny.name).stat().st_size == tiny.stat().st_size  # the full GGUF copy
    assert (debris / LOCK_FILE).is_file()
    young = work_folder(cache, "lockless-young")

    ir = resolve_model(tiny, cache_dir=cache, log=quiet)

    assert leftovers(cache) == [young]  # an unlocked folder may still be starting up
    assert all((ir / f).is_file() for f in ir_cache.IR_FILES + ir_cache.TOKENIZER_FILES)
    assert not (ir / LOCK_FILE).exists() and not (ir / tiny.name).exists()
    info = json.loads((ir / SOURCE_INFO).read_text())
    assert info["context_length"] == 2048
    (ir / SOURCE_INFO).unlink()  # a cache written before the record existed gets it back
    assert resolve_model(tiny, cache_dir=cache, log=quiet) == ir
    assert json.loads((ir / SOURCE_INFO).read_text()) == info
