"""The package's public names: every one in ``__all__`` loads (``from npuw_kv import *``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_star_import_gives_every_public_name():
    # a fresh interpreter: the names load lazily, on first use
    code = (
        "import npuw_kv\n"
        "names = {}\n"
        "exec('from npuw_kv import *', names)\n"
        "missing = [n for n in npuw_kv.__all__ if n not in names]\n"
        "assert not missing, missing\n"
        "print(len(npuw_kv.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 20
