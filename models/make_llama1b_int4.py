"""Build a Llama-3.2-1B-shaped model with random weights, int4 symmetric channel-wise.

The command the measurements of that model quote; the same as ``python
models/make_standin.py OUT_DIR --shape llama-3.2-1b --weights int4`` (see make_standin.py)::

    python models/make_llama1b_int4.py OUT_DIR     # a few minutes; ~0.6 GiB of IR
"""

from __future__ import annotations

import sys

from make_standin import main

if __name__ == "__main__":
    main([*sys.argv[1:], "--shape", "llama-3.2-1b", "--weights", "int4"])
