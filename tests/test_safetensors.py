"""The safetensors reader behind LoRA adapters opens only regular files of a size that fits,
and checks every header field, naming the file and the tensor (no model)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from npuw_kv.model.safetensors import read_safetensors


def _file(path, header: dict, body: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return str(path)


def _tensor(**fields) -> dict:
    return {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **fields}}


@pytest.mark.unit
def test_a_good_file_reads_back(tmp_path):
    body = np.array([1.5, -2.0], np.float32).tobytes()
    path = _file(tmp_path / "ok.safetensors", _tensor(), body)
    np.testing.assert_array_equal(read_safetensors(path)["t"], [1.5, -2.0])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"shape": 5}, r"tensor 't' has shape 5 in the header"),
        ({"shape": [-1, -1]}, r"has shape \[-1, -1\]"),
        ({"shape": ["2"]}, r"has shape \['2'\]"),
        ({"shape": [True]}, r"has shape \[True\]"),
        ({"data_offsets": [0, 4, 8]}, r"has data_offsets \[0, 4, 8\].*expected \[begin, end\]"),
        ({"data_offsets": ["0", "8"]}, r"has data_offsets \['0', '8'\]"),
        ({"data_offsets": [0, 4]}, r"bytes \[0, 4\) that do not hold its shape"),
        ({"shape": [2**62, 2**62]}, "do not hold its shape"),
        ({"dtype": ["F32"]}, r"is \['F32'\]; LoRA matrices are"),
        ({"dtype": "I64"}, "is I64; LoRA matrices are"),
    ],
)
def test_bad_header_fields_are_named(tmp_path, fields, refused):
    path = _file(tmp_path / "a.safetensors", _tensor(**fields), bytes(8))
    with pytest.raises(ValueError, match=refused) as error:
        read_safetensors(path)
    assert "a.safetensors" in str(error.value)


@pytest.mark.unit
def test_a_header_longer_than_the_file_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="a header of 1000000000 bytes in a file of 10"):
        read_safetensors(path)


@pytest.mark.unit
def test_only_regular_files_are_opened(tmp_path):
    fifo = tmp_path / "adapter.fifo"
    os.mkfifo(fifo)  # reading it would block until a writer came
    with pytest.raises(ValueError, match="adapter.fifo' is not a regular file"):
        read_safetensors(fifo)
    with pytest.raises(ValueError, match="'/dev/zero' is not a regular file"):
        read_safetensors("/dev/zero")  # reading it would never end
    with pytest.raises(ValueError, match="is not a regular file"):
        read_safetensors(tmp_path)
    with pytest.raises(ValueError, match="cannot be read"):
        read_safetensors(tmp_path / "missing.safetensors")
    # genai's Adapter raises RuntimeError: code written for it catches these too
    with pytest.raises(RuntimeError, match="cannot be read"):
        read_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(RuntimeError, match="not a safetensors file"):
        (tmp_path / "short.safetensors").write_bytes(b"abc")
        read_safetensors(tmp_path / "short.safetensors")


@pytest.mark.unit
def test_an_adapter_giving_a_layer_twice_is_refused_naming_both_keys(tmp_path):
    from npuw_kv.api.adapters import Adapter

    first, second = "model.layers.0.q_proj.lora_A.weight", "model.layers.0.q_proj.lora_down.weight"
    header = {
        first: {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]},
        second: {"dtype": "F32", "shape": [1, 2], "data_offsets": [8, 16]},
        "model.layers.0.q_proj.lora_B.weight": {
            "dtype": "F32",
            "shape": [2, 1],
            "data_offsets": [16, 24],
        },
    }
    path = _file(tmp_path / "twice.safetensors", header, bytes(24))
    with pytest.raises(ValueError, match=f"lora_A twice: '{first}' and '{second}'"):
        Adapter(path)
