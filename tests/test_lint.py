"""The code stays ruff- and mypy-clean (the project's own standard, enforced in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from npuw_kv.model.ir_cache import cache_root

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


def mypy_cache() -> Path:
    """mypy's incremental cache, kept beside the converted models (``NPUW_KV_CACHE_DIR``, else
    ~/.cache/npuw-kv) so that it outlives a fresh clone: a cold run spends most of its time
    reading torch, transformers and openai, which do not change between runs
    (docs/measurements.md); mypy checks again every module whose source or dependencies
    changed."""
    return cache_root() / f"mypy-py{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.slow(seconds=60)  # its cold run (a first run on a machine); warm it takes seconds
def test_mypy_clean():
    checked = (d for d in CODE if d != "tests")
    result = run("mypy", "--cache-dir", str(mypy_cache()), *checked)
    assert result.returncode == 0, result.stdout + result.stderr
