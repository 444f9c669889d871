"""The suite's own scheduling (conftest.py): files with slow tests first, each file kept whole."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from conftest import pytest_collection_modifyitems


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
