"""Prompts of exact token lengths from real English text that every machine has.

The text is the docstrings of a fixed list of Python standard-library modules, in a fixed
order, so the same length gives the same ids on every machine with the same Python.
"""

from __future__ import annotations

import importlib
import inspect

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


def stdlib_text() -> str:
    """Concatenated docstrings of the module list and their public classes and functions."""
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
    return "\n\n".join(parts)


def prompt_ids(tokenizer, num_tokens: int) -> np.ndarray:
    """The first ``num_tokens`` ids of the stdlib text (raises if the text is too short)."""
    ids = np.asarray(tokenizer.encode(stdlib_text()).input_ids.data, np.int64).reshape(-1)
    if ids.size < num_tokens:
        raise ValueError(f"stdlib text has {ids.size} tokens, fewer than the {num_tokens} asked")
    return ids[:num_tokens].copy()
