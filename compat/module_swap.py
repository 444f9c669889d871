"""The module swap: a copy of a tree of Python files whose ``openvino_genai`` imports name
``npuw_kv`` instead, as a user's one-line change would (``import npuw_kv as openvino_genai``).

Used by ``genai_suite.py`` (genai's tests) and ``genai_samples.py`` (genai's samples); the
original tree is never changed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

# `import openvino_genai as x` / `import openvino_genai` / `from openvino_genai import ...`
_IMPORT_AS = re.compile(r"^(\s*)import\s+openvino_genai\s+as\s+", re.MULTILINE)
_IMPORT = re.compile(r"^(\s*)import\s+openvino_genai\s*(#.*)?$", re.MULTILINE)
_FROM = re.compile(r"^(\s*)from\s+openvino_genai\s+import\b", re.MULTILINE)


def swap_imports(source: str) -> tuple[str, int]:
    """``source`` with each ``openvino_genai`` import made an ``npuw_kv`` one; how many."""
    count = 0
    for pattern, replacement in (
        (_IMPORT_AS, r"\1import npuw_kv as "),
        (_IMPORT, r"\1import npuw_kv as openvino_genai"),
        (_FROM, r"\1from npuw_kv import"),
    ):
        source, n = pattern.subn(replacement, source)
        count += n
    return source, count


def swapped_tree(source: Path, target: Path) -> int:
    """Copy ``source`` to ``target`` (replacing it) with every ``.py`` file's ``openvino_genai``
    imports swapped; the number of imports swapped."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    total = 0
    for path in sorted(target.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        swapped, count = swap_imports(text)
        if count:
            path.write_text(swapped, encoding="utf-8")
            total += count
    return total
