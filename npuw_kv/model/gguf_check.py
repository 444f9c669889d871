"""Check that a GGUF file is whole and sane before openvino-genai's converter reads it.

The converter maps the file and follows its counts and offsets without bounds checks, so a
truncated download or a corrupt header makes it read past the mapping and the process dies
with SIGSEGV.  gguf-py's reader walks the same structure in Python; here each of its reads is
bounds-checked and each tensor's data range is checked against the file size, so a bad file
ends as a one-line message instead, naming the metadata key or tensor it was reading.  Only the
metadata is read: the tensor data stays unread in the memory map.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import stat
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

import gguf
import numpy as np
import numpy.typing as npt

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml and the converter keep at most 4 dims per tensor
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count
# the fewest bytes a metadata entry (key length, value type, 1-byte value) and a tensor
# description (name length, dim count, type, offset) take: a count the file cannot hold is
# corrupt, and is caught before gguf-py loops over it
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_ARRAY_HEADER_BYTES = 4 + 8  # item type, item count
_ARRAY = int(gguf.GGUFValueType.ARRAY)  # an int: comparing with the enum member is slow
_MAX_NAME_SHOWN = 80  # a corrupt name length: the first bytes are enough to name it


class _Part(NamedTuple):
    """A list in the file, for messages: its section, what names an item, what an item is."""

    section: str
    name: str
    item: str


_METADATA = _Part("metadata", "key", "metadata entry")
_TENSORS = _Part("tensor table", "tensor", "tensor description")


class GGUFProblem(ValueError):
    """What makes a file unsafe to give to the converter (the message says what, not which)."""


def check_gguf(path: Path) -> gguf.GGUFReader:
    """Raise :class:`GGUFProblem` unless ``path`` is a GGUF the converter can read safely.

    Returns the reader so its metadata can be used without a second (slow) read.
    """
    size = _file_size(path)
    _check_header(path, size)
    reader = _read(path, size)
    _check_contents(reader)
    return reader


def _file_size(path: Path) -> int:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise GGUFProblem("no such file") from None
    except OSError as exc:
        raise GGUFProblem(f"cannot read it: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise GGUFProblem("it is a directory, not a GGUF file")
    if not stat.S_ISREG(info.st_mode):
        raise GGUFProblem("not a regular file")
    if info.st_size == 0:
        raise GGUFProblem("empty file (0 bytes)")
    return info.st_size


def _check_header(path: Path, size: int) -> None:
    """Magic, version and counts: gguf-py loops ``count`` times on whatever the header says."""
    try:
        with path.open("rb") as file:
            head = file.read(_HEADER.size)
    except OSError as exc:
        raise GGUFProblem(f"cannot read it: {exc.strerror}") from None
    if not head.startswith(GGUF_MAGIC) and not GGUF_MAGIC.startswith(head):
        raise GGUFProblem(f"not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    if len(head) < _HEADER.size:
        raise GGUFProblem(f"truncated: {size} bytes, less than the {_HEADER.size}-byte header")
    _, version, n_tensors, n_keys = _HEADER.unpack(head)
    if version and not version & 0xFFFF:  # gguf-py's own test for the other byte order
        raise GGUFProblem("a big-endian GGUF, which openvino-genai's converter cannot read")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFProblem(f"GGUF version {version}, not one of {SUPPORTED_VERSIONS}")
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_keys * _MIN_KV_BYTES > size - _HEADER.size:
        raise GGUFProblem(
            f"truncated or corrupt: the header lists {n_tensors:,} tensors and {n_keys:,} "
            f"metadata keys, more than {size:,} bytes can hold"
        )


def _read(path: Path, size: int) -> gguf.GGUFReader:
    """gguf-py's reader, its failures (of any type) turned into :class:`GGUFProblem`."""
    try:
        return _BoundedReader(path)
    except GGUFProblem:
        raise
    except _PastEnd as exc:
        raise GGUFProblem(
            f"truncated or corrupt: the metadata runs to byte {exc.end:,}, beyond the file's "
            f"{size:,} bytes"
        ) from None
    except Exception as exc:  # gguf-py's ValueError, KeyError, IndexError, UnicodeError...
        raise GGUFProblem(f"corrupt metadata: {_describe(exc)}") from exc


def _check_contents(reader: gguf.GGUFReader) -> None:
    """The converter picks its model builder by ``general.architecture`` and needs tensors."""
    arch = reader.fields.get("general.architecture")
    if arch is None:
        raise GGUFProblem("no general.architecture key (the converter needs the model family)")
    try:
        name = arch.contents() if arch.types == [gguf.GGUFValueType.STRING] else None
    except UnicodeDecodeError:
        name = None
    if not name:
        raise GGUFProblem("general.architecture is not a model family name")
    if not reader.tensors:
        raise GGUFProblem("no tensors")
    _check_vocabulary(reader)


def _check_vocabulary(reader: gguf.GGUFReader) -> None:
    """Every token id the tokenizer can produce needs an embedding row: fewer rows make the
    model look up rows that are not there (garbage, or a crash in the gather)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tokens is None or embedding is None or len(embedding.shape) < 2:
        return
    vocab = len(tokens.data)
    rows = int(embedding.shape[-1])  # GGUF lists dims fastest first: [n_embd, n_vocab]
    if rows < vocab:
        raise GGUFProblem(
            f"the embedding token_embd.weight has {rows:,} rows, fewer than the tokenizer's "
            f"{vocab:,} tokens"
        )


def _describe(exc: Exception) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _PastEnd(Exception):
    """A read that would end at byte ``end``, past the end of the file."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


class _BoundedReader(gguf.GGUFReader):
    """gguf-py's reader with every read bounds-checked and tensor ranges checked.

    gguf-py returns a short (even empty) array for a read past the end, so a corrupt count can
    keep it looping for minutes and a truncated tensor fails far from its cause.  The
    overridden methods are private to gguf-py; the ``gguf`` version is pinned.
    """

    @cached_property
    def _bytes(self) -> npt.NDArray[np.uint8]:
        # a plain view: slicing the np.memmap costs three times as much (__array_finalize__)
        return self.data.view(np.ndarray)

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: None | Literal["I", "S", "<"] = None,
    ) -> npt.NDArray[Any]:
        item = np.dtype(dtype)
        end = offset + item.itemsize * int(count)
        if end > self._bytes.size:
            raise _PastEnd(end)
        array = self._bytes[offset:end].view(item)
        return array.view(array.dtype.newbyteorder(override_order or self.byte_order))

    def _build_fields(self, offs: int, count: int) -> int:
        """gguf-py's loop, one metadata entry at a time: what goes wrong names the entry's key
        (an unknown value type, a key that is not UTF-8, a repeated key...)."""
        for index in range(int(count)):
            with self._naming(_METADATA, offs, index, int(count)):
                offs = super()._build_fields(offs, 1)
        return offs

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[gguf.ReaderField]]:
        """gguf-py's loop, one tensor description at a time, for the same reason."""
        fields: list[gguf.ReaderField] = []
        for index in range(int(count)):
            with self._naming(_TENSORS, offs, index, int(count)):
                offs, found = super()._build_tensor_info(offs, 1)
            fields += found
        return offs, fields

    @contextlib.contextmanager
    def _naming(self, part: _Part, offset: int, index: int, count: int) -> Iterator[None]:
        """Failures reading item ``index`` (at ``offset``) of ``part`` as a GGUFProblem that
        names the item; a read past the end is left to :func:`_read` (the item is garbage)."""
        try:
            yield
        except _PastEnd:
            raise
        except GGUFProblem as exc:
            raise GGUFProblem(f"{exc} ({self._item(part, offset, index, count)})") from None
        except Exception as exc:  # gguf-py's ValueError, KeyError, UnicodeError...
            where = self._item(part, offset, index, count)
            raise GGUFProblem(f"corrupt {part.section}: {where}: {_describe(exc)}") from exc

    def _item(self, part: _Part, offset: int, index: int, count: int) -> str:
        """Item ``index`` of ``part`` for a message: its name (as far as it reads) and place."""
        place = f"{part.item} {index + 1:,} of {count:,}"
        try:
            length = int(self._get(offset, np.uint64)[0])
            raw = bytes(self._get(offset + 8, np.uint8, min(length, _MAX_NAME_SHOWN)))
        except _PastEnd:
            return f"{place}, at byte {offset:,}"
        shown = repr(raw.decode("utf-8", "replace")) + ("..." if length > len(raw) else "")
        return f"{part.name} {shown}, {place}"

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        if int(raw_type) == _ARRAY:  # once per value: 150k times for a 49k-token vocabulary
            self._check_array(orig_offs)
        return super()._get_field_parts(orig_offs, raw_type)

    def _check_array(self, offset: int) -> None:
        """An item count the rest of the file cannot hold: gguf-py would loop over it."""
        item_type = int(self._get(offset, np.uint32)[0])
        count = int(self._get(offset + 4, np.uint64)[0])
        room = self._bytes.size - offset - _ARRAY_HEADER_BYTES
        if count * self._min_value_bytes(item_type) > room:
            raise GGUFProblem(
                f"corrupt metadata: an array of {count:,} items at byte {offset:,} cannot fit "
                f"in the file's {self._bytes.size:,} bytes"
            )

    def _min_value_bytes(self, raw_type: int) -> int:
        try:
            value_type = gguf.GGUFValueType(raw_type)
        except ValueError:
            return 1  # gguf-py rejects the type next
        if value_type == gguf.GGUFValueType.STRING:
            return 8
        if value_type == gguf.GGUFValueType.ARRAY:
            return _ARRAY_HEADER_BYTES
        scalar = self.gguf_scalar_to_np.get(value_type)
        return np.dtype(scalar).itemsize if scalar is not None else 1

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        extents = sorted(_check_tensor(field, start_offs, self._bytes.size) for field in fields)
        # a tensor declared larger than its data runs into the next one: the converter would
        # read its neighbour's bytes as its own (and build a graph of the wrong size)
        for (start, end, name), (next_start, _, next_name) in itertools.pairwise(extents):
            if end > next_start:
                raise GGUFProblem(
                    f"corrupt tensor table: tensor {name!r} (bytes {start:,} to {end:,}) runs "
                    f"into tensor {next_name!r}, which starts at byte {next_start:,}"
                )
        super()._build_tensors(start_offs, fields)


def _check_tensor(field: gguf.ReaderField, data_start: int, size: int) -> tuple[int, int, str]:
    """Dims, type and data range of one tensor description (before gguf-py maps its data);
    its data's (start, end) bytes and its name."""
    _, name_data, n_dims, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    if int(n_dims[0]) > MAX_DIMS:
        raise GGUFProblem(f"tensor {name!r} has {int(n_dims[0])} dims, more than {MAX_DIMS}")
    try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFProblem(f"tensor {name!r} has unknown type {int(raw_type[0])}") from None
    shape = [int(d) for d in dims]
    if shape and shape[0] % block:
        raise GGUFProblem(
            f"tensor {name!r}: rows of {shape[0]} values are not whole {qtype.name} blocks "
            f"of {block}"
        )
    start = data_start + int(offset[0])
    end = start + math.prod(shape) // block * type_size
    if end > size:
        raise GGUFProblem(
            f"truncated: tensor {name!r} ends at byte {end:,}, beyond the file's {size:,} bytes"
        )
    return start, end, name
