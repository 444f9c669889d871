"""The module map in docs/design.md lists every module of the package as it is now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import module_map  # noqa: E402

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_the_design_docs_module_map_is_current() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    assert module_map.current(text) == module_map.module_map(), (
        "docs/design.md's module map is out of date: run python scripts/module_map.py --write"
    )


def test_the_map_names_every_module_and_a_missing_one_is_caught(tmp_path: Path) -> None:
    fresh = module_map.module_map()
    for path in (ROOT / "npuw_kv").rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            assert f"`{path.relative_to(ROOT).as_posix()}`" in fresh, path
    stale = fresh.replace("| `npuw_kv/kv/slots.py` |", "| `npuw_kv/kv/gone.py` |")
    assert module_map.current(f"x\n{stale}\ny") != fresh


def test_the_script_prints_the_map() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "module_map.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == module_map.module_map()
