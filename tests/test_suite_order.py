"""The suite's own scheduling (conftest.py): files with slow tests first, each file kept whole;
and the quick tier's guard (a ``unit`` test builds no model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import openvino as ov
import pytest
from conftest import UnitTierError, check_unit_fixtures, pytest_collection_modifyitems

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


@dataclass
class _Item:
    nodeid: str
    marks: dict[str, pytest.Mark] = field(default_factory=dict)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self.marks.get(name)


def _slow(seconds: float) -> dict[str, pytest.Mark]:
    return {"slow": pytest.mark.slow(seconds=seconds).mark}


def test_slow_files_go_first_longest_first_and_files_stay_whole() -> None:
    items = [
        _Item("tests/test_a.py::one"),
        _Item("tests/test_b.py::quick"),
        _Item("tests/test_b.py::long", _slow(100)),
        _Item("tests/test_a.py::two"),
        _Item("tests/test_c.py::x", _slow(60)),
        _Item("tests/test_c.py::y", _slow(60)),  # 120 s in all: before test_b.py
        _Item("tests/test_d.py::z"),
    ]
    pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_c.py::x",
        "tests/test_c.py::y",
        "tests/test_b.py::quick",
        "tests/test_b.py::long",
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_d.py::z",
    ]


def test_a_unit_test_that_compiles_a_model_fails() -> None:
    """The quick tier's guard: inside a ``unit`` test, compiling is an error."""
    param = ov.opset13.parameter([1, 4], ov.Type.f32)
    model = ov.Model([ov.opset13.relu(param)], [param])
    with pytest.raises(UnitTierError, match="marked unit but builds a model"):
        ov.Core().compile_model(model, "CPU")


def test_a_unit_test_that_takes_a_model_fixture_fails() -> None:
    check_unit_fixtures("t.py::ok", ["tmp_path", "request"])
    with pytest.raises(UnitTierError, match=r"uses \['f32_pipe'\]"):
        check_unit_fixtures("t.py::bad", ["tmp_path", "f32_pipe"])
