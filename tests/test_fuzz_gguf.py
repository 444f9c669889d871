"""GGUF metadata under property-based fuzzing (issue #57): whatever a GGUF's header, metadata
and tensor table hold, :func:`check_gguf` returns a reader whose tensors lie inside the file or
raises :class:`GGUFProblem`; never another exception, a hang or a crash (openvino-genai's
converter, which only ever sees files that passed, dies with SIGSEGV on the same damage)."""

from __future__ import annotations

import contextlib
import signal
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npuw_kv.model.gguf_check import GGUFProblem, check_gguf

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TIME_LIMIT_S = 5.0  # a check of these files takes milliseconds; a loop over a bogus count, ages
VT = gguf.GGUFValueType
Q8_0 = gguf.GGMLQuantizationType.Q8_0


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so that no ``except Exception`` can swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"check_gguf ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def write_gguf(path: Path, metadata: dict[str, tuple[Any, VT, VT | None]]) -> bytes:
    """A small GGUF with ``metadata`` (key -> value, type, item type) and three tensors (f32,
    f16, Q8_0; the embedding's 8 rows match an 8-piece vocabulary); its bytes."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, (value, kind, item) in metadata.items():
        writer.add_key_value(key, value, kind, item)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.add_tensor("blk.0.norm", np.ones((2, 4), np.float16))
    q8 = gguf.quants.quantize(np.ones((2, 32), np.float32), Q8_0)
    writer.add_tensor("blk.0.q8", q8, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


# every value type, strings and arrays (of numbers, strings and arrays) among them
BASE_METADATA: dict[str, tuple[Any, VT, VT | None]] = {
    "general.name": ("fuzz", VT.STRING, None),
    "fuzz.u8": (7, VT.UINT8, None),
    "fuzz.i8": (-7, VT.INT8, None),
    "fuzz.u16": (700, VT.UINT16, None),
    "fuzz.i16": (-700, VT.INT16, None),
    "fuzz.u32": (70_000, VT.UINT32, None),
    "fuzz.i32": (-70_000, VT.INT32, None),
    "fuzz.f32": (0.5, VT.FLOAT32, None),
    "fuzz.u64": (2**40, VT.UINT64, None),
    "fuzz.i64": (-(2**40), VT.INT64, None),
    "fuzz.f64": (0.25, VT.FLOAT64, None),
    "fuzz.bool": (True, VT.BOOL, None),
    "tokenizer.ggml.tokens": (["a", "b", "ä", "<s>", "", "xyz", "q", "東"], VT.ARRAY, VT.STRING),
    "tokenizer.ggml.token_type": ([1] * 8, VT.ARRAY, VT.INT32),
    "tokenizer.ggml.scores": ([0.5] * 8, VT.ARRAY, VT.FLOAT32),
    "fuzz.nested": ([[1, 2], [3]], VT.ARRAY, VT.ARRAY),
}


@dataclass(frozen=True)
class Base:
    """The valid file and where its numbers are: each u64 / u32 of the header, the metadata
    and the tensor table, named ``<field>[<part>.<element>]`` after gguf-py's field parts
    (a metadata entry: key length, key, value type, then the value's parts; an array's are its
    item type, its count, then each item's)."""

    data: bytes
    slots: dict[str, tuple[int, str]]  # name -> (offset, struct format)
    metadata_end: int


@cache
def base() -> Base:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base.gguf"
        data = write_gguf(path, BASE_METADATA)
        reader = check_gguf(path)
        slots = {}
        for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
            offset = field.offset
            for i, part in enumerate(field.parts):
                fmt = {np.uint64: "<Q", np.uint32: "<I"}.get(part.dtype.type)
                for j in range(part.size if fmt else 0):
                    slots[f"{field.name}[{i}.{j}]"] = (offset + j * part.itemsize, fmt)
                offset += part.nbytes
        end = int(reader.data_offset)
        del reader  # its memory map, before the folder goes
    return Base(data, slots, end)


SIZES = [0, 1, 2, 7, 8, 9, 12, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
MUTATION = st.one_of(
    # a header count, key or string length, value or item type, array count, tensor dim...
    st.tuples(
        st.just("set"),
        st.deferred(lambda: st.sampled_from(sorted(base().slots))),
        st.sampled_from(SIZES) | st.integers(0, 40) | st.integers(0, 2**64 - 1),
    ),
    st.tuples(  # any byte of the header, metadata or tensor table
        st.just("byte"),
        st.deferred(lambda: st.integers(0, base().metadata_end - 1)),
        st.integers(0, 255),
    ),
    st.tuples(st.just("cut"), st.deferred(lambda: st.integers(0, len(base().data))), st.none()),
    st.tuples(  # bytes dropped: everything after them is read out of step
        st.just("drop"),
        st.deferred(lambda: st.integers(0, base().metadata_end)),
        st.integers(1, 16),
    ),
)


def mutated(mutations: list[tuple[str, Any, Any]]) -> bytes:
    data = bytearray(base().data)
    for kind, where, value in mutations:
        if kind == "set":
            offset, fmt = base().slots[where]
            if fmt == "<I":
                value &= 0xFFFFFFFF
            if offset + struct.calcsize(fmt) <= len(data):
                struct.pack_into(fmt, data, offset, value)
        elif kind == "byte" and where < len(data):
            data[where] = value
        elif kind == "cut":
            del data[where:]
        elif kind == "drop":
            del data[where : where + value]
    return bytes(data)


def checked(data: bytes) -> tuple[gguf.GGUFReader | None, str | None]:
    """check_gguf on ``data`` in a file: (its reader, None) or (None, its GGUFProblem)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(data)
        try:
            with time_limit(TIME_LIMIT_S):
                return check_gguf(path), None
        except GGUFProblem as exc:
            return None, str(exc)


@pytest.mark.unit
@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
@example([("set", "GGUF.kv_count[0.0]", 2**64 - 1)])
@example([("set", "tokenizer.ggml.tokens[4.0]", 2**40)])  # the vocabulary's item count
@example([("set", "tokenizer.ggml.tokens[5.0]", 2**63)])  # its first piece's length
@example([("set", "fuzz.u8[2.0]", 77)])  # a value type that does not exist
@example([("set", "fuzz.nested[3.0]", 9)])  # an array of arrays of arrays
@example([("set", "blk.0.q8[3.0]", 33)])  # rows that are not whole Q8_0 blocks
@example([("set", "blk.0.q8[2.0]", 9)])  # nine dims
@example([("cut", 100, None)])
def test_any_damaged_gguf_reads_or_is_a_gguf_problem(mutations):
    data = mutated(mutations)
    reader, problem = checked(data)
    if reader is None:
        assert problem and "\n" not in problem
        return
    assert "general.architecture" in reader.fields
    for tensor in reader.tensors:  # what passed is safe to map: each tensor inside the file
        assert tensor.data_offset + tensor.n_bytes <= len(data), tensor.name


def test_the_fuzz_damages_the_file_each_way():
    """The mutations reach every kind of failure: a fuzz that only ever truncated would pass
    the test above as well."""
    problems = {
        name: checked(mutated(mutations))[1]
        for name, mutations in {
            "count": [("set", "GGUF.tensor_count[0.0]", 2**63)],
            "array": [("set", "tokenizer.ggml.tokens[4.0]", 2**40)],
            "type": [("set", "fuzz.u8[2.0]", 77)],
            "dims": [("set", "blk.0.q8[2.0]", 9)],
            "key": [("byte", base().slots["fuzz.i8[0.0]"][0] + 8, 0xFF)],
        }.items()
    }
    assert "the header lists 9,223,372,036,854,775,808 tensors" in problems["count"]
    assert problems["array"].startswith("corrupt metadata: an array of 1,099,511,627,776 items")
    assert problems["array"].endswith("(key 'tokenizer.ggml.tokens', metadata entry 14 of 17)")
    assert problems["type"].startswith("corrupt metadata: key 'fuzz.u8', metadata entry 3 of")
    assert "not a valid GGUFValueType" in problems["type"]
    assert problems["dims"] == "tensor 'blk.0.q8' has 9 dims, more than 4"
    assert problems["key"].startswith("corrupt metadata: key '\ufffduzz.i8', metadata entry 4")
    assert "UnicodeDecodeError" in problems["key"]


# --- valid files of any metadata pass, values intact ----------------------------------------

SCALARS: dict[VT, st.SearchStrategy[Any]] = {
    VT.UINT8: st.integers(0, 2**8 - 1),
    VT.INT8: st.integers(-(2**7), 2**7 - 1),
    VT.UINT16: st.integers(0, 2**16 - 1),
    VT.INT16: st.integers(-(2**15), 2**15 - 1),
    VT.UINT32: st.integers(0, 2**32 - 1),
    VT.INT32: st.integers(-(2**31), 2**31 - 1),
    VT.UINT64: st.integers(0, 2**64 - 1),
    VT.INT64: st.integers(-(2**63), 2**63 - 1),
    VT.FLOAT32: st.floats(width=32, allow_nan=False),
    VT.FLOAT64: st.floats(allow_nan=False),
    VT.BOOL: st.booleans(),
    VT.STRING: st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
}


@st.composite
def entry(draw: st.DrawFn) -> tuple[Any, VT, VT | None]:
    kind = draw(st.sampled_from(list(SCALARS)))
    if draw(st.booleans()):
        return draw(SCALARS[kind]), kind, None
    return draw(st.lists(SCALARS[kind], min_size=1, max_size=6)), VT.ARRAY, kind


@pytest.mark.unit
@FUZZ
@given(
    metadata=st.dictionaries(
        st.text(st.characters(exclude_categories=("Cs",)), max_size=16).map("fuzz.".__add__),
        entry(),
        max_size=6,
    )
)
def test_any_valid_metadata_passes_with_its_values(metadata):
    with tempfile.TemporaryDirectory() as tmp:
        data = write_gguf(Path(tmp) / "valid.gguf", metadata)
    reader, problem = checked(data)
    assert problem is None and reader is not None
    for key, (value, kind, item) in metadata.items():
        field = reader.fields[key]
        assert field.types == ([kind] if item is None else [kind, item])
        assert field.contents() == value
