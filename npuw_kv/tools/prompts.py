"""Prompts of exact token lengths from real English text that every machine has.

The text is the docstrings of a fixed list of Python standard-library modules, in a fixed
order, so the same length gives the same ids on every machine with the same Python.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import numpy as np

_MODULES = (
    "argparse",
    "collections",
    "json",
    "functools",
    "itertools",
    "pathlib",
    "subprocess",
    "threading",
    "logging",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "heapq",
    "bisect",
    "textwrap",
    "string",
    "re",
    "csv",
    "sqlite3",
    "unittest",
    "typing",
    "dataclasses",
    "enum",
    "contextlib",
    "shutil",
    "tempfile",
    "zipfile",
    "tarfile",
    "email",
    "http.client",
    "urllib.parse",
    "asyncio",
    "concurrent.futures",
    "multiprocessing",
    "pickle",
    "copy",
    "pprint",
    "random",
    "math",
    "operator",
    "abc",
    "io",
    "os",
    "sys",
    "time",
    "calendar",
    "difflib",
    "doctest",
)


def stdlib_docstrings() -> list[str]:
    """Docstrings of the module list and their public classes and functions, in order."""
    parts: list[str] = []
    for name in _MODULES:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module)
        if doc:
            parts.append(doc)
        for attr in sorted(getattr(module, "__all__", []) or []):
            obj = getattr(module, attr, None)
            if obj is not None and (inspect.isclass(obj) or inspect.isfunction(obj)):
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(doc)
    return parts


def stdlib_text() -> str:
    """The docstrings joined by blank lines: the text the prompts are cut from."""
    return "\n\n".join(stdlib_docstrings())


def prompt_ids(tokenizer: Any, num_tokens: int) -> np.ndarray:
    """The first ``num_tokens`` ids of the stdlib text (raises if the text is too short).

    The text is encoded one docstring at a time, each with the blank line that precedes it in
    the text, until there are enough ids.  Encoding it whole would let the tokenizer decide:
    openvino-genai's GGUF tokenizer keeps only the *last* 8192 tokens of a long input, which
    took the prompts from the end of the text and capped them at 8192 tokens.  The pieces split
    where byte-level BPE pre-tokenization splits anyway, so they give the ids of the whole text.
    """
    ids: list[int] = []
    for i, doc in enumerate(stdlib_docstrings()):
        text = doc if i == 0 else "\n\n" + doc
        encoded = tokenizer.encode(text, add_special_tokens=i == 0).input_ids.data
        ids.extend(int(t) for t in np.asarray(encoded).reshape(-1))
        if len(ids) >= num_tokens:
            return np.asarray(ids[:num_tokens], np.int64)
    raise ValueError(f"stdlib text has {len(ids)} tokens, fewer than the {num_tokens} asked")
