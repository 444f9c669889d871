"""Read a ``.safetensors`` file (how PEFT saves LoRA adapters) into float32 numpy arrays.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the bytes.  Adapters are megabytes, so the file is read whole; no
dependency is needed for it.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..kv.memory import ensure_fits

_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
HEADER_LIMIT = 100 * 2**20  # the format's own bound on the JSON header


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32, by name; ``UsageError`` (a ``ValueError`` and a
    ``RuntimeError``, as genai's ``Adapter`` raises) naming the file and what
    is wrong when it is missing, damaged or holds a non-float tensor."""
    where = Path(path)
    try:
        info = where.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read, /dev/zero never end
            raise UsageError(f"LoRA adapter {str(where)!r} is not a regular file")
        ensure_fits(info.st_size, f"LoRA adapter {str(where)!r}")
        data = where.read_bytes()
    except OSError as exc:
        raise UsageError(f"LoRA adapter {str(where)!r} cannot be read: {exc.strerror}") from exc
    except MemoryError as exc:
        raise UsageError(str(exc)) from exc
    if len(data) < 8:
        raise UsageError(f"LoRA adapter {str(where)!r} is not a safetensors file (too short)")
    size = int.from_bytes(data[:8], "little")
    if size > min(HEADER_LIMIT, len(data) - 8):
        raise UsageError(
            f"LoRA adapter {str(where)!r} is not a safetensors file (a header of {size} bytes "
            f"in a file of {len(data)})"
        )
    try:
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as exc:
        raise UsageError(f"LoRA adapter {str(where)!r} is not a safetensors file ({exc})") from exc
    body = memoryview(data)[8 + size :]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(where, name, info, body)
    return out


def _tensor(where: Path, name: str, info: object, body: memoryview) -> np.ndarray:
    def bad(why: str) -> UsageError:
        return UsageError(f"LoRA adapter {str(where)!r}: tensor {name!r} {why}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad("has no dtype, shape and data_offsets in the header")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise bad(f"has shape {shape!r} in the header: expected a list of sizes >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets)):
        raise bad(f"has data_offsets {offsets!r} in the header: expected [begin, end]")
    begin, end = offsets
    if dtype not in (*_FLOATS, "BF16"):
        raise bad(f"is {dtype}; LoRA matrices are F32, F16, BF16 or F64")
    itemsize = 2 if dtype == "BF16" else np.dtype(_FLOATS[dtype]).itemsize
    count = math.prod(shape)  # exact: a huge shape cannot wrap round
    if not 0 <= begin <= end <= len(body) or end - begin != count * itemsize:
        raise bad(
            f"has bytes [{begin}, {end}) that do not hold its shape {shape} (file cut short?)"
        )
    raw = body[begin:end]  # in range and sized: checked above
    if dtype == "BF16":  # the upper half of a float32
        values = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, _FLOATS[dtype]).astype(np.float32)
    return values.reshape(shape)


def _count(value: object) -> bool:
    """A size or offset as the header must give it: an int >= 0 (not a bool or a string)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
