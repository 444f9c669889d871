"""The code stays ruff- and mypy-clean (the project's own standard, enforced in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True)


CODE = ("npuw_kv", "tests", "scripts", "models", "compat")


def test_ruff_clean():
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_formatted():
    result = run("ruff", "format", "--check", *CODE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow(seconds=60)
def test_mypy_clean():
    result = run("mypy", *(d for d in CODE if d != "tests"))
    assert result.returncode == 0, result.stdout + result.stderr
