"""No module of the package reads or writes another object's underscore attributes.

A class's ``_name`` is its own business: another class that needs it gets a public port
instead (the scheduler asks the paged runner for ``writing()`` and ``last_logits``, the
pipeline faces ask the engine).  Only ``self``, ``cls`` and ``super()`` may be followed by
``._name``; the few foreign libraries' privates that must be called are listed with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# (module, attribute): why it is reached from outside its class
FOREIGN = {
    ("npuw_kv/generation/stopping.py", "_write"): (
        "openvino_genai.TextParserStreamer takes tokens only through _write, as genai's "
        "pipeline feeds it"
    ),
    ("npuw_kv/tools/children.py", "_exit"): (
        "os._exit is the documented way for a child between fork and exec to end without "
        "running its parent's clean-up"
    ),
}


def private_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each ``x._name`` whose ``x`` is not self, cls or super()."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # dunders are the language's
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Name)
            and owner.func.id == "super"
        ):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_module_reaches_into_another_objects_privates() -> None:
    bad = []
    for path in sorted((ROOT / "npuw_kv").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for line, expr in private_accesses(path.read_text()):
            if (module, expr.rsplit(".", 1)[1]) not in FOREIGN:
                bad.append(f"{module}:{line}: {expr}")
    assert not bad, "private attributes read from outside their class:\n" + "\n".join(bad)


def test_the_check_catches_what_it_should() -> None:
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._a = other._b\n"  # caught: other._b
        "        super()._c()\n"
        "        return self.runner._d, type(self)._e, self.__dict__\n"  # caught: _d, _e
    )
    assert [expr for _, expr in private_accesses(source)] == [
        "other._b",
        "self.runner._d",
        "type(self)._e",
    ]
