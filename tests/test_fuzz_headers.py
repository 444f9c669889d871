"""File headers under property-based fuzzing (robustness round 4): whatever a safetensors
header or a cache manifest holds, reading it gives the tensors / the entry's state, or an error
of the documented kind naming the file; never a raw TypeError, KeyError or a hang."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuw_kv.model.cache_entry import MANIFEST, entry_problem
from npuw_kv.model.safetensors import read_safetensors

# any JSON value, a few levels deep
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# a tensor entry: mostly the right keys, each with any value or a plausible one
ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64"]) | JSON,
        "shape": st.lists(st.integers(-3, 6), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-4, 300), min_size=0, max_size=3) | JSON,
    },
)
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.unit
@FUZZ
@given(
    header=st.dictionaries(st.text(max_size=12), ENTRY | JSON, max_size=4),
    body=st.binary(max_size=256),
    declared=st.none() | st.integers(0, 2**64 - 1),
)
def test_any_safetensors_header_reads_or_is_refused_by_name(header, body, declared):
    raw = json.dumps(header).encode()
    size = len(raw) if declared is None else declared
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(struct.pack("<Q", size) + raw + body)
        try:
            tensors = read_safetensors(path)
        except ValueError as exc:
            assert "fuzz.safetensors" in str(exc)
            return
    for name, array in tensors.items():
        info = header[name]
        assert list(array.shape) == list(info["shape"]) and array.dtype.name == "float32"


@pytest.mark.unit
@FUZZ
@given(manifest=st.dictionaries(st.sampled_from(["version", "files", "x"]), JSON, max_size=3))
def test_any_cache_manifest_reads_as_whole_or_damaged(manifest):
    with tempfile.TemporaryDirectory() as tmp:
        entry = Path(tmp)
        (entry / "a").write_bytes(b"x")
        (entry / MANIFEST).write_text(json.dumps(manifest))
        problem = entry_problem(entry, ["a"])
    assert problem is None or isinstance(problem, str)
